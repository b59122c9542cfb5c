package coordinator

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// A failed verdict's per-group reasons (issue 27) never cost the engine
// its verdict: one that fits is sent whole, one that fits only without
// GroupReasons is sent without them (Failed and Reasons intact), not
// refused with too_large. Seen red with restore.wait answered by reply
// (code too_large).
func TestVerdictReplyDropsGroupReasonsToFit(t *testing.T) {
	const maxPayload = 16 << 10
	c := startCoord(t, func(cfg *Config) { cfg.Embedded.MaxPayload = maxPayload })
	nc := connect(t, c)
	sub, err := c.nc.SubscribeSync("test.verdict")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := c.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	verdict := func(chunks int) wire.RestoreVerdict {
		v := wire.RestoreVerdict{RestoreID: "r", State: wire.VerdictFailed, Prefix: chunks}
		for i := range chunks {
			v.Failed = append(v.Failed, i)
			v.Reasons = append(v.Reasons, fmt.Sprintf("chunk %d: rank 0 group 0 shard 0: missing", i))
			v.GroupReasons = append(v.GroupReasons, []string{"rank 0 group 0 shard 0: missing",
				"rank 0 group 1 shard 0: corrupt " + strings.Repeat("x", 100)})
		}
		return v
	}
	for _, tc := range []struct {
		chunks     int
		wantGroups bool
	}{{8, true}, {100, false}} {
		v := verdict(tc.chunks)
		got := make(chan *wire.RestoreVerdict, 1)
		errc := make(chan error, 1)
		go func() {
			rep, err := bus.Call[wire.RestoreVerdict](tctx(t), nc, "test.verdict", struct{}{})
			got <- rep
			errc <- err
		}()
		m, err := sub.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.replyVerdict(m, &v)
		rep, err := <-got, <-errc
		if err != nil {
			t.Fatalf("%d chunks: %v", tc.chunks, err)
		}
		if len(rep.Failed) != tc.chunks || len(rep.Reasons) != tc.chunks || (len(rep.GroupReasons) > 0) != tc.wantGroups {
			t.Fatalf("%d chunks: got %d failed, %d reasons, %d group reasons; want %d, %d and group reasons %v",
				tc.chunks, len(rep.Failed), len(rep.Reasons), len(rep.GroupReasons), tc.chunks, tc.chunks, tc.wantGroups)
		}
	}
}
