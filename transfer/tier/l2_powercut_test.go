package tier

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/powercut"
	"github.com/kvtier/kvtier/internal/testutil"
)

// Power-cut tests of the L2 file tier on a real file system (issue 29.6).
// l2crash_test.go models the disk from what FileTier tells its observer,
// so it cannot see a system call that is missing while the observer is
// still told (the helper's f.Sync() removed). Here the tier runs on a
// powercut mount, which keeps only what was fsynced, and the power is cut
// at every mutation of: opening the tier on a root it creates, puts in two
// namespaces (the second creating its directory) and overwrites of two
// objects. After each crash every object whose Put returned nil reads back
// byte-exact (verified: header MAC, checksum): its last acknowledged
// bytes, or those of the Put in flight at the cut.

type l2put struct {
	obj     L2Object
	payload []byte
}

func l2Workload() []l2put {
	var puts []l2put
	for i := range 6 {
		o, p := testObj(40 + i)
		if i%2 == 1 {
			o.Key.NS = dcp.Namespace{8}
		}
		puts = append(puts, l2put{o, p})
	}
	for j, i := range []int{0, 3} { // overwrites: same key, new bytes
		o := puts[i].obj
		p := testutil.RandomBytes(o.Size, uint64(900+j))
		o.Sum = checksum.Sum(p)
		puts = append(puts, l2put{o, p})
	}
	return puts
}

// runL2PowerCut runs the workload on fs at every cut point with Put's
// durability steps less ab, and returns, for each cut that lost or tore an
// acknowledged object, a line saying which (the first only, with first).
func runL2PowerCut(t *testing.T, fs *powercut.FS, name string, ab l2Ablation, first bool) (losses []string, total int64) {
	key, err := NewMACKey(bytes.Repeat([]byte{0x5c}, 32))
	if err != nil {
		t.Fatal(err)
	}
	puts := l2Workload()
	n := 0
	run := func(cut int64) (acked int, root string) {
		n++
		parent := filepath.Join(fs.Dir(), fmt.Sprintf("%s-%d", name, n))
		if err := os.Mkdir(parent, 0o700); err != nil {
			t.Fatal(err)
		}
		powercut.SyncDir(t, fs.Dir())
		powercut.SyncDir(t, parent)
		root = filepath.Join(parent, "l2")
		if cut >= 0 {
			fs.CutAfter(cut)
		}
		ft, err := OpenFileTier(root, key)
		if err == nil {
			ft.ab = ab
			for _, p := range puts {
				if err = ft.Put(t.Context(), p.obj, p.payload); err != nil {
					break
				}
				acked++
			}
		}
		if err != nil && cut < 0 {
			t.Fatalf("uncut run: %v", err)
		}
		if cut >= 0 {
			fs.Crash()
		}
		return acked, root
	}
	before := fs.Ops()
	run(-1)
	total = fs.Ops() - before
	for cut := range total + 1 {
		if first && len(losses) > 0 {
			break
		}
		acked, root := run(cut)
		ft, err := OpenFileTier(root, key)
		if err != nil {
			t.Fatalf("power cut after %d of %d mutations, %d puts acknowledged: reopen: %v", cut, total, acked, err)
		}
		// What each key must hold: its last acknowledged bytes, or the
		// bytes of the put in flight.
		want := map[dcp.Key][]byte{}
		for _, p := range puts[:acked] {
			want[p.obj.Key] = p.payload
		}
		var inFlight *l2put
		if acked < len(puts) {
			inFlight = &puts[acked]
		}
		for k, w := range want {
			got := make([]byte, len(w))
			_, err := ft.Get(t.Context(), k, [32]byte{}, got)
			if err == nil && (bytes.Equal(got, w) || inFlight != nil && inFlight.obj.Key == k && bytes.Equal(got, inFlight.payload)) {
				continue
			}
			what := "other bytes"
			if err != nil {
				what = err.Error()
			}
			losses = append(losses, fmt.Sprintf("power cut after %d of %d mutations, %d of %d puts acknowledged: object %s: %s",
				cut, total, acked, len(puts), k, what))
		}
	}
	return losses, total
}

func TestL2PowerCutFileSystem(t *testing.T) {
	fs := powercut.Mount(t)
	losses, total := runL2PowerCut(t, fs, "run", l2Ablation{}, false)
	if len(losses) > 0 {
		t.Errorf("%d acknowledged objects lost or torn over %d crash points; the first: %s", len(losses), total+1, losses[0])
	}
	t.Logf("%d mutations, each a crash point", total)
}

// TestL2PowerCutFileSystemSeesEveryMissingStep: with any one of Put's
// durability steps removed (through the same switches as
// TestL2PowerCutSeesEveryMissingStep, but on a file system that loses
// what was not synced) an acknowledged object is lost or torn.
func TestL2PowerCutFileSystemSeesEveryMissingStep(t *testing.T) {
	fs := powercut.Mount(t)
	for i, c := range []struct {
		name string
		ab   l2Ablation
	}{
		{"no file fsync", l2Ablation{noFileSync: true}},
		{"no directory fsync", l2Ablation{noDirSync: true}},
		{"no temp + rename", l2Ablation{noRename: true}},
	} {
		name := c.name
		if losses, _ := runL2PowerCut(t, fs, fmt.Sprintf("ab%d", i), c.ab, true); len(losses) == 0 {
			t.Errorf("with %s no power cut lost an acknowledged object: the test cannot see that step", name)
		} else {
			t.Logf("%s: %s", name, losses[0])
		}
	}
}
