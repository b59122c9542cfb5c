package transfer

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/kvtier/kvtier/internal/testutil"
)

// TestFailingL2NeverBlocksL1 (issue 11.3): with every L2 write failing
// under write-through, stores keep succeeding on L1 (objects whose write
// failed are dropped from L1 when room is needed, counted), the tier is
// reported degraded (log and gauge), writes are skipped while it is, and
// the recent objects still restore byte-exact from L1.
func TestFailingL2NeverBlocksL1(t *testing.T) {
	for _, policy := range []L2Policy{WriteThrough, WriteBackOnEvict} {
		t.Run(policy.String(), func(t *testing.T) {
			dev := openDevice(t, "")
			const n = 40
			r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
			ft, err := OpenFileTier(t.TempDir(), nil)
			if err != nil {
				t.Fatal(err)
			}
			dead := &faultyTier{L2Tier: ft, failPuts: -1}
			core, logs := observer.New(zap.WarnLevel)
			cfg := engineConfig(t, dev, 0, 1)
			cfg.L2, cfg.L2Policy, cfg.Logger = dead, policy, zap.New(core)
			cfg.L1Bytes = 16 * (64 << 10) // 16 one-slab objects
			e := newEngine(t, cfg)
			r.register(e)
			var cs []chunk
			for i := range n {
				c := r.newChunk(i, r.consecutiveN(i))
				cs = append(cs, c)
				res := storeAll(t, e, r, "s", c) // fails the test on any failed object
				if res.Objects[0].Status != Stored {
					t.Fatalf("store %d: %+v", i, res.Objects[0])
				}
			}
			st := e.Stats()
			if st.L2WriteErrors == 0 && policy == WriteThrough {
				t.Fatal("no L2 write was even tried")
			}
			if st.L1Full != 0 || st.StoreFailures[ReasonNoSpace] != 0 || st.L2DroppedDirty == 0 {
				t.Fatalf("%d objects stored into 16 slabs with L2 dead, none counted dropped: %+v", n, st)
			}
			if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_degraded"); v != 1 {
				t.Fatalf("l2_degraded = %v, want 1", v)
			}
			if logs.FilterMessage("L2 is failing: writes are skipped and objects only L1 holds are dropped when L1 needs room").Len() != 1 {
				t.Fatalf("no single warning that L2 is degraded: %v", logs.All())
			}
			// The last objects are in L1 and restore byte-exact.
			last := cs[n-4:]
			var tgts [][][]int64
			for i := range last {
				tgts = append(tgts, r.consecutiveN(n+i))
			}
			rr, err := e.Retrieve(testCtx(t), r.retrieveReq(0, last, tgts))
			if err != nil {
				t.Fatal(err)
			}
			for i := range last {
				if !rr.ChunkOK(i) {
					t.Fatalf("chunk %d of the last four: %+v", i, rr.Items[i])
				}
				r.expectRestored(last[i], tgts[i])
			}
			r.check("restored from L1 with L2 failing")

			// The disk comes back: a probe write (after its backoff) ends
			// the degradation, and what L1 still holds reaches L2.
			dead.mu.Lock()
			dead.failPuts = 0
			dead.mu.Unlock()
			deadline := time.Now().Add(20 * time.Second)
			for e.Stats().L2Degraded {
				if time.Now().After(deadline) {
					t.Fatal("L2 still degraded 20 s after it recovered")
				}
				time.Sleep(5 * time.Millisecond)
			}
			if err := e.Flush(testCtx(t)); err != nil {
				t.Fatalf("Flush after L2 recovered: %v", err)
			}
			// Flush succeeded: nothing only L1 holds is left.
			if st := e.Stats(); st.L2Objects < st.L1Objects || st.L2Objects == 0 {
				t.Fatalf("after recovery L2 holds %d objects, L1 %d; want every L1 object in L2", st.L2Objects, st.L1Objects)
			}
			if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_degraded"); v != 0 {
				t.Fatalf("l2_degraded = %v after recovery", v)
			}
		})
	}
}
