package admin

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestMain(m *testing.M) { testutil.Main(m) }

func rankd(instance string, tp int, inc uint64, st cluster.MemberState) cluster.Member {
	return cluster.Member{ID: instance + "-" + string(rune('0'+tp)), State: st,
		Meta: cluster.Meta{Role: cluster.RoleRankd, Engine: instance, TPRank: tp, Incarnation: inc}}
}

// TestRanks: the index's ranks are joined with the member of the same
// incarnation, else the newest member of the rank; members the index
// does not know are listed; the order is instance, then TP rank.
func TestRanks(t *testing.T) {
	a0 := wire.Rank{Instance: "a", TPRank: 0}
	a1 := wire.Rank{Instance: "a", TPRank: 1}
	b0 := wire.Rank{Instance: "b", TPRank: 0}
	ranks := []index.RankInfo{{Rank: b0, Incarnation: 5}, {Rank: a1, Incarnation: 3, Fenced: true}, {Rank: a0, Incarnation: 2}}
	members := []cluster.Member{
		rankd("a", 0, 2, cluster.StateAlive),
		rankd("a", 1, 4, cluster.StateAlive), // a restart the index has not seen
		rankd("c", 0, 9, cluster.StateDead),  // unknown to the index
		{ID: "coord", Meta: cluster.Meta{Role: cluster.RoleCoordinator}},
	}
	rep := Ranks(ranks, members, map[wire.Rank]bool{a1: true})
	want := []struct {
		rank     string
		liveness string
		resync   bool
	}{
		{"a/0", "alive", false},
		{"a/1", "alive (incarnation 4)", true},
		{"b/0", "unknown", false},
		{"c/0", "dead", false},
	}
	if len(rep.Ranks) != len(want) {
		t.Fatalf("%d ranks, want %d: %+v", len(rep.Ranks), len(want), rep.Ranks)
	}
	for i, w := range want {
		got := rep.Ranks[i]
		if got.Rank.String() != w.rank || got.Liveness != w.liveness || got.Resync != w.resync {
			t.Errorf("rank %d: %s %q resync %v, want %s %q resync %v", i, got.Rank, got.Liveness, got.Resync, w.rank, w.liveness, w.resync)
		}
	}
	var out bytes.Buffer
	if err := WriteRanksTable(&out, rep); err != nil || !bytes.Contains(out.Bytes(), []byte("alive (incarnation 4)")) {
		t.Fatalf("ranks table: %v\n%s", err, out.String())
	}
}

// TestReplicasAgree: replicas at one raft index must share a digest, and
// each must have verified clean.
func TestReplicasAgree(t *testing.T) {
	ok := wire.AdminVerifyReply{OK: true}
	reps := []wire.AdminRaftVerifyReply{
		{ID: "n1", RaftIndex: 7, Digest: "aa", Verify: ok},
		{ID: "n2", RaftIndex: 7, Digest: "aa", Verify: ok},
		{ID: "n3", RaftIndex: 6, Digest: "bb", Verify: ok},
	}
	if err := ReplicasAgree(reps); err != nil {
		t.Fatal(err)
	}
	bad := append([]wire.AdminRaftVerifyReply(nil), reps...)
	bad[1].Digest = "ab"
	if err := ReplicasAgree(bad); !errors.Is(err, ErrReplicas) || !errors.Is(err, index.ErrInconsistent) {
		t.Fatalf("digest mismatch: %v", err)
	}
	bad = append([]wire.AdminRaftVerifyReply(nil), reps...)
	bad[2].Verify.OK = false
	if err := ReplicasAgree(bad); !errors.Is(err, ErrReplicas) {
		t.Fatalf("failed verification: %v", err)
	}
}
