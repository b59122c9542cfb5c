package e2e

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// TestRestartWith10kL2Objects is restartWithManyL2Objects with 10,000
// objects (about 40 s here); TestSoakRestartWith100kL2Objects (make soak)
// with 100,000 (about 2 min).
func TestRestartWith10kL2Objects(t *testing.T) { restartWithManyL2Objects(t, 10_000) }

func TestSoakRestartWith100kL2Objects(t *testing.T) {
	if os.Getenv("KVTIER_SOAK") != "1" {
		t.Skip("soak: set KVTIER_SOAK=1 (make soak)")
	}
	restartWithManyL2Objects(t, 100_000)
}

// restartWithManyL2Objects (issue 15.2): rank 0's L2 holds n small
// objects of its own (written straight into the tier, in its file
// format) besides a stored prompt, and one payload byte of the prompt's
// MLA object of chunk 2 is flipped while the ranks are down. Restarted,
// rank 0 serves before its background rescan (headers only) has ended
// ("rankd serving" is logged before "L2 rescanned"; the time to serve is
// logged), the restore fails exactly chunk 2 (the corrupted object is
// caught on read and quarantined), and the rescan announces all n objects
// to the coordinator.
//
// Measured here (2-core VM, make soak): 100,016 objects, serving 106 ms
// after the start, rescan 27 s.
func restartWithManyL2Objects(t *testing.T, n int) {
	c := newKV(t, 4)
	c.startAll()
	c.mustSim("--scenario", "tp4dcp1", "--phase", "store")
	c.waitL2([]int64{16, 8, 8, 8})
	c.stopRanks()

	rank0 := wire.Rank{Instance: "engine0", TPRank: 0}
	var ns dcp.Namespace
	copy(ns[:], "kvtier-100k-test")
	dir := filepath.Join(c.l2D, ns.String())
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The objects carry the cluster's storage MAC, or the rescan would
	// not announce them (C12).
	var mac *transfer.MACKey
	if !c.insecure {
		secret, err := auth.LoadStorageKey(filepath.Join(c.creds, auth.StorageKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		if mac, err = transfer.NewMACKey(secret); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Now()
	payload := make([]byte, 64)
	for i := range n {
		var ch dcp.ChunkHash
		binary.BigEndian.PutUint64(ch[:], uint64(i))
		key := dcp.Key{NS: ns, Chunk: ch, Shard: 0, Group: 0}
		binary.BigEndian.PutUint64(payload, uint64(i))
		obj := transfer.L2Object{Key: key, Writer: rank0, Incarnation: 1, Size: uint64(len(payload)),
			Sum: checksum.Sum(payload), Created: time.Unix(1_700_000_000, int64(i))}
		if err := os.WriteFile(filepath.Join(dir, key.String()+".kvo"), transfer.EncodeObject(obj, payload, mac), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("wrote %d L2 objects in %v", n, time.Since(t0).Round(time.Millisecond))

	// Flip one payload byte of rank 0's MLA object of chunk 2.
	sc, err := enginesim.LookupScenario("tp4dcp1")
	if err != nil {
		t.Fatal(err)
	}
	plan, err := enginesim.NewPlan(sc, 1)
	if err != nil {
		t.Fatal(err)
	}
	tier, err := transfer.OpenFileTier(c.l2D, nil)
	if err != nil {
		t.Fatal(err)
	}
	bad := tier.Path(dcp.Key{NS: plan.R.Namespace, Chunk: plan.Hashes[2], Shard: 0, Group: 0})
	b, err := os.ReadFile(bad)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-7] ^= 0x20
	if err := os.WriteFile(bad, b, 0o600); err != nil {
		t.Fatal(err)
	}

	t0 = time.Now()
	c.startRank(0)
	t.Logf("rank 0 with %d L2 objects: serving and alive at the coordinator %v after its start", n+16, time.Since(t0).Round(time.Millisecond))
	for r := 1; r < c.tp; r++ {
		c.startRank(r)
	}
	c.eventually(60*time.Second, "rank 0's rescan ends", func() error {
		if !strings.Contains(c.ranks[0].output(), `"msg":"L2 rescanned"`) {
			return fmt.Errorf("still rescanning")
		}
		return nil
	})
	out := c.ranks[0].output()
	serving, rescanned := strings.Index(out, `"msg":"rankd serving"`), strings.Index(out, `"msg":"L2 rescanned"`)
	if serving < 0 || serving > rescanned {
		t.Fatalf("rank 0 logged \"rankd serving\" at %d, \"L2 rescanned\" at %d: it did not serve before its rescan ended\n%s",
			serving, rescanned, tail(out, 20))
	}
	t.Logf("rescan: %s", lineWith(out, `"msg":"L2 rescanned"`))

	res, simOut, err := c.sim("--scenario", "tp4dcp1", "--phase", "restore", "--expect-fail")
	if err != nil || res == nil || !res.OK || res.Verdict != wire.VerdictFailed || !equalInts(res.Failed, []int{2}) {
		t.Fatalf("restore with chunk 2's MLA object corrupted: %+v %v\n%s", res, err, tail(simOut, 40))
	}
	if _, err := os.Stat(bad); !os.IsNotExist(err) {
		t.Fatalf("the corrupted object is still in place: %v", err)
	}
	c.eventually(60*time.Second, "the coordinator holds rank 0's extra L2 objects", func() error {
		k, err := c.rankInfo(0)
		if err != nil {
			return err
		}
		if want := int64(n + 16 - 1); k.L2Objects != want {
			return fmt.Errorf("rank 0: %d L2 objects in the index, want %d", k.L2Objects, want)
		}
		return nil
	})
}
