package coordinator

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// getHealth fetches /healthz: status code and decoded body.
func getHealth(t *testing.T, c *Coordinator) (int, map[string]string) {
	t.Helper()
	resp, err := http.Get("http://" + c.HTTPAddr() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var h map[string]string
	if err := json.Unmarshal(body, &h); err != nil {
		t.Fatalf("healthz body %q: %v", body, err)
	}
	return resp.StatusCode, h
}

// TestHealthzReflectsIndex (issue 11.6): once the index has failed for
// good (here: its file may not grow), /healthz answers 503 and says the
// index failed; NATS and the cluster are reported too. On f044f94 it
// stayed 200 "ok".
func TestHealthzReflectsIndex(t *testing.T) {
	c := startCoord(t, func(cfg *Config) { cfg.IndexMaxFileBytes = 1 << 20 })
	code, h := getHealth(t, c)
	if code != http.StatusOK || h["status"] != "ok" || h["index"] != "ok" || h["nats"] != "connected" || h["cluster"] != "alive" {
		t.Fatalf("healthz of a fresh coordinator: %d %v", code, h)
	}
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	r := wire.Rank{Instance: "full", TPRank: 0}
	var seq uint64
	failed := false
	for i := 0; i < 200 && !failed; i++ {
		chunks := make([]dcp.ChunkHash, 512)
		for j := range chunks {
			chunks[j][0], chunks[j][1], chunks[j][2] = byte(i), byte(j), byte(j>>8)
		}
		_, werr := sendBatch(t, nc, c.subj, storeBatch(r, 1, seq, ns, chunks, wire.L1))
		seq += 512
		if werr != nil {
			if werr.Code != wire.CodeInternal {
				t.Fatalf("batch %d: %v", i, werr)
			}
			failed = true
		}
	}
	if !failed {
		t.Fatal("the capped index never failed")
	}
	code, h = getHealth(t, c)
	if code != http.StatusServiceUnavailable || h["status"] != "unavailable" || !strings.HasPrefix(h["index"], "failed: ") ||
		h["nats"] != "connected" || h["cluster"] != "alive" {
		t.Fatalf("healthz after the index failed: %d %v", code, h)
	}
	t.Logf("healthz: %v", h)
}

// TestHealthzReflectsNATS: with its (external) NATS server gone, /healthz
// answers 503 naming the connection's state, and 200 again once the
// server is back.
func TestHealthzReflectsNATS(t *testing.T) {
	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port = 0
	ecfg.Insecure = true
	ext, err := bus.StartEmbedded(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	c := startCoord(t, func(cfg *Config) { cfg.NATSURL = ext.ClientURL() })
	if code, h := getHealth(t, c); code != http.StatusOK || h["nats"] != "connected" {
		t.Fatalf("healthz: %d %v", code, h)
	}
	_, port, _ := net.SplitHostPort(ext.Addr())
	ext.Shutdown()
	testutil.Eventually(t, 10*time.Second, "healthz to report NATS down", func() bool {
		code, h := getHealth(t, c)
		return code == http.StatusServiceUnavailable && h["status"] == "unavailable" &&
			(h["nats"] == "reconnecting" || h["nats"] == "disconnected") && h["index"] == "ok"
	})
	// The same port again: the client reconnects.
	ecfg.Port, _ = strconv.Atoi(port)
	ext2, err := bus.StartEmbedded(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ext2.Shutdown()
	testutil.Eventually(t, 10*time.Second, "healthz to recover", func() bool {
		code, _ := getHealth(t, c)
		return code == http.StatusOK
	})
	c.Shutdown() // before its NATS server goes
}

// TestProductionIndexSyncs (issue 11.7): the coordinator opens its index
// with fsync on every commit and on growth; NoFreelistSync is the one
// relaxation, and it is safe (the freelist is rebuilt at Open).
func TestProductionIndexSyncs(t *testing.T) {
	c := startCoord(t, nil)
	if d := c.Index().Durability(); d.NoSync || d.NoGrowSync || !d.NoFreelistSync {
		t.Fatalf("coordinator's index opened with %+v, want NoSync=false NoGrowSync=false NoFreelistSync=true", d)
	}
}
