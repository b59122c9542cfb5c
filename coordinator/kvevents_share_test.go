package coordinator

import (
	"slices"
	"testing"

	"github.com/kvtier/kvtier/wire"
)

// TestKVEventsShareGroupL1L3 (issue 26.1, 26.4): with ShareHostL1 and
// ShareL3, a member's L1 and L3 copies count for the whole group, as its
// L2 copies do: chat-a's L1 copy of c0 is announced in CPU for chat-b too,
// its L3 copy of c1 in STORAGE/L3 for both. Seen red with kvTiers
// ignoring ShareL3 (chat-b got no event for c1) and ShareHostL1 (none
// for c0).
func TestKVEventsShareGroupL1L3(t *testing.T) {
	c := startCoord(t, func(cfg *Config) {
		cfg.KVEvents, cfg.HostSharedL1, cfg.ShareHostL1, cfg.ShareL3 = true, true, true, true
		cfg.ShareGroups = []ShareGroup{{Name: "chat", Instances: []string{"chat-a", "chat-b"}}}
	})
	nc := connect(t, c)
	ns := register(t, nc, c.subj, testSpec(1))
	k := newKVRouter(t, c, nc)
	a := wire.Rank{Instance: "chat-a"}
	c0, c1 := chain(ns, 1, 3), chain(ns, 1, 4)
	k.names[c0[0]], k.names[c1[0]] = "c0", "c1"
	for i, x := range []struct {
		ch   string
		tier wire.Tier
		want string
	}{{"c0", wire.L1, "BlockStored CPU 16 [c0]"}, {"c1", wire.L3, "BlockStored STORAGE/L3 16 [c1]"}} {
		ch := c0
		if x.ch == "c1" {
			ch = c1
		}
		send(t, nc, c.subj, storeBatch(a, 1, uint64(i), ns, ch, x.tier))
		want := []string{x.want}
		if got := k.barrierAll(); len(got) != 2 || !slices.Equal(got["chat-a"], want) || !slices.Equal(got["chat-b"], want) {
			t.Fatalf("%s in chat-a's %s: events %q, want %q for chat-a and chat-b", x.ch, x.tier, got, want)
		}
	}
}
