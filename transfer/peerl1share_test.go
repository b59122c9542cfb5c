package transfer

import (
	"errors"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestPeerL1ShareGroupMember (issue 26.1): ranks of instances a, b and c
// on one host keep their L1 in one host L1 directory, under write-back (a
// writes nothing to L2). b, given a in HostL1SharedWith, restores a's
// chunks byte-exact straight from a's segment, reading no L2 and holding
// nothing in its own L1; c, not given a, finds nothing. Seen red with
// findPeers ignoring HostL1SharedWith (b: not in L1, not in L2).
func TestPeerL1ShareGroupMember(t *testing.T) {
	dev := openDevice(t, "")
	dir := hostL1Dir(t)
	engineOf := func(inst string, shared ...string) (*Engine, *rig) {
		return shareMember(t, dev, inst, func(c *Config) {
			c.HostL1Dir, c.HostL1SharedWith = dir, shared
			c.L2Dir, c.L2Policy = t.TempDir(), WriteBackOnEvict
		})
	}
	ea, ra := engineOf("a")
	cs := []chunk{ra.newChunk(0, ra.consecutiveN(0)), ra.newChunk(1, ra.consecutiveN(1))}
	storeAll(t, ea, ra, "a", cs...)

	eb, rb := engineOf("b", "a")
	tgt := [][][]int64{rb.consecutiveN(4), rb.consecutiveN(5)}
	if rr := restoreAll(t, eb, rb, "b after restoring from a's segment", cs, tgt); rr.Items[0].From != wire.L1 {
		t.Fatalf("b's retrieve of a's L1 objects: %+v", rr)
	}
	if st := eb.Stats(); st.PeerL1Reads != 2 || st.L2Reads != 0 || st.L1Objects != 0 || st.PeerL1Failures != 0 {
		t.Fatalf("b's stats: peer reads %d, L2 reads %d, own L1 objects %d, peer failures %d",
			st.PeerL1Reads, st.L2Reads, st.L1Objects, st.PeerL1Failures)
	}

	ec, rc := engineOf("c")
	rr, err := ec.Retrieve(testCtx(t), rc.retrieveReq(0, cs[:1], tgt[:1]))
	if err != nil || rr.ChunkOK(0) || !errors.Is(rr.Items[0].Err, ErrNotFound) {
		t.Fatalf("c (not sharing with a): %+v %v, want not found", rr, err)
	}
	if st := ec.Stats(); st.PeerL1Reads != 0 {
		t.Fatalf("c read %d objects from a peer's L1", st.PeerL1Reads)
	}

	cfg := engineConfig(t, dev, 0, 1)
	cfg.HostL1SharedWith = []string{"a"}
	if e, err := New(cfg); !errors.Is(err, ErrConfig) {
		if e != nil {
			closeEngine(t, e)
		}
		t.Fatalf("host L1 shared without HostL1Dir: New = %v, want ErrConfig", err)
	}
}
