package rankd

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/internal/powercut"
	"github.com/kvtier/kvtier/wire"
)

// TestPowerCutIncarnation (issue 29.6): a saved incarnation survives a
// power cut, so a restart never reuses one. The coordinator drops every
// batch of an incarnation not above the rank's last one (C7); a start
// whose saved incarnation was lost would fall back to the clock, and after
// the clock stepped back that is an incarnation already used. Here the L2
// directory is on a powercut mount (only what was fsynced survives), the
// saved incarnations are far ahead of the clock (the stepped-back case,
// where only the file orders them) and the power is cut at every mutation
// of a series of saves for two ranks, the first creating the
// incarnations directory. After each crash the next start of each rank
// must get an incarnation above every one acknowledged for it.
func TestPowerCutIncarnation(t *testing.T) {
	fs := powercut.Mount(t)
	ranks := []wire.Rank{{Instance: "pc", TPRank: 0}, {Instance: "pc", TPRank: 1}}
	base := cluster.NewIncarnation() + 1<<50 // a clock that stepped back by ~13 days
	const saves = 8
	// run saves incarnations in a new L2 directory (made durable first)
	// until one fails; it returns the highest acknowledged per rank.
	run := func(name string, cut int64) (acked []uint64, l2 string) {
		l2 = filepath.Join(fs.Dir(), name)
		if err := os.Mkdir(l2, 0o700); err != nil {
			t.Fatal(err)
		}
		powercut.SyncDir(t, fs.Dir())
		if cut >= 0 {
			fs.CutAfter(cut)
		}
		acked = make([]uint64, len(ranks))
		for i := range saves {
			tp := i % len(ranks)
			inc := base + uint64(i)
			if err := saveIncarnation(l2, ranks[tp], inc); err != nil {
				if cut < 0 {
					t.Fatalf("save %d: %v", inc, err)
				}
				break
			}
			acked[tp] = inc
		}
		if cut >= 0 {
			fs.Crash()
		}
		return acked, l2
	}
	before := fs.Ops()
	run("uncut", -1)
	total := fs.Ops() - before
	for cut := range total + 1 {
		acked, l2 := run(fmt.Sprintf("cut-%d", cut), cut)
		for tp, r := range ranks {
			next, err := peekIncarnation(l2, r)
			switch {
			case err != nil:
				t.Fatalf("power cut after %d of %d mutations: the next start of rank %s fails: %v", cut, total, r, err)
			case next <= acked[tp]:
				t.Fatalf("power cut after %d of %d mutations: the next start of rank %s gets incarnation %d, not above %d saved before the cut",
					cut, total, r, next, acked[tp])
			}
		}
	}
}
