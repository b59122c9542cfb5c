package transfer

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/tier"
	"github.com/kvtier/kvtier/wire"
)

// diskUse sums the sizes of the regular files under root (objects,
// temporary files of writes in flight; not the quarantine) and lists the
// object files by name.
func diskUse(t *testing.T, root string) (uint64, map[string]bool) {
	t.Helper()
	var total uint64
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) {
				return nil // a temporary file renamed or removed meanwhile
			}
			return err
		}
		if d.IsDir() {
			if d.Name() == tier.QuarantineDir {
				return filepath.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if os.IsNotExist(err) {
			return nil
		}
		if err != nil {
			return err
		}
		total += uint64(info.Size())
		if strings.HasSuffix(d.Name(), tier.FileExt) && !strings.HasPrefix(d.Name(), tier.TmpPrefix) {
			names[d.Name()] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return total, names
}

// TestL2BoundHolds (issue 15.2): with a small L2Bytes under a long stream
// of stores, the files on disk never exceed the bound (checked after every
// store), no store fails, every eviction is announced as an L2 removal and
// counted, and after a flush the rank's L2 inventory is exactly the files
// on disk.
func TestL2BoundHolds(t *testing.T) {
	for _, tc := range []struct {
		policy  L2Policy
		writers int
	}{{WriteThrough, 1}, {WriteThrough, 4}, {WriteBackOnEvict, 1}, {WriteBackOnEvict, 4}} {
		policy := tc.policy
		t.Run(fmt.Sprintf("%s/writers=%d", policy, tc.writers), func(t *testing.T) {
			dev := openDevice(t, "")
			const n = 60
			r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
			root := t.TempDir()
			cfg := engineConfig(t, dev, 0, 1)
			cfg.L2Dir, cfg.L2Policy, cfg.KeepEvents = root, policy, true
			cfg.L1Bytes = 8 * (64 << 10) // 8 one-slab objects: write-back evicts often
			const bound = 300 << 10
			cfg.L2Bytes = bound
			cfg.L2Writers = tc.writers
			e := newEngine(t, cfg)
			pub := recordEvents(t, e)
			r.register(e)
			var objBytes uint64
			for i := range n {
				c := r.newChunk(i, r.consecutiveN(i))
				res := storeAll(t, e, r, fmt.Sprintf("prompt-%d", i), c) // a stream of prompts; fails the test on any failed object
				for _, o := range res.Objects {
					if o.Status != Stored {
						t.Fatalf("store %d: %+v", i, o)
					}
				}
				if used, _ := diskUse(t, root); used > bound {
					t.Fatalf("after store %d: %d B of files under L2, bound %d B", i, used, bound)
				}
				if objBytes == 0 {
					objBytes = r.res.ObjectSize(0) + tier.HeaderBytes(cfg.Rank.Instance)
				}
			}
			if err := e.Flush(testCtx(t)); err != nil {
				t.Fatal(err)
			}
			used, files := diskUse(t, root)
			if used > bound {
				t.Fatalf("after flush: %d B of files, bound %d B", used, bound)
			}
			// LRU evicts only what it must: with one writer, one more
			// object would not fit. (Concurrent writers reserve room for
			// the whole new file before writing, so the last writes of a
			// stream can leave up to writers-1 objects of room.)
			if tc.writers == 1 && used+objBytes <= bound {
				t.Fatalf("after flush: %d B of files, bound %d B: evicted more than needed for %d B objects", used, bound, objBytes)
			}
			inv := map[string]bool{}
			for _, p := range e.Inventory().Objects {
				if p.Tier == wire.L2 {
					inv[p.Key.String()+tier.FileExt] = true
				}
			}
			if len(inv) != len(files) {
				t.Fatalf("inventory holds %d L2 objects, disk %d files", len(inv), len(files))
			}
			for f := range files {
				if !inv[f] {
					t.Fatalf("file %s is not in the inventory", f)
				}
			}
			st := e.Stats()
			if st.L2Evictions == 0 || st.L2Evictions+uint64(len(files)) != n {
				t.Fatalf("%d L2 evictions, %d files left of %d objects", st.L2Evictions, len(files), n)
			}
			if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_evictions_total"); v != float64(st.L2Evictions) {
				t.Fatalf("l2_evictions_total = %v, Stats %d", v, st.L2Evictions)
			}
			if v := testutil.Metric(t, gatherer(t, e), "kvtier_transfer_l2_bytes"); v != float64(used) {
				t.Fatalf("l2_bytes = %v, files %d B", v, used)
			}
			closeEngine(t, e)
			stored, removed := map[dcp.Key]int{}, map[dcp.Key]int{}
			for _, ev := range pub.events() {
				if ev.Tier != wire.L2 {
					continue
				}
				switch ev.Kind {
				case wire.Stored:
					stored[ev.Key]++
				case wire.Removed:
					removed[ev.Key]++
				}
			}
			if len(stored) != n || uint64(len(removed)) != st.L2Evictions {
				t.Fatalf("events: %d objects stored to L2, %d removed; want %d and %d", len(stored), len(removed), n, st.L2Evictions)
			}
		})
	}
}

// freeTier reports the free space of a simulated file system of capacity
// bytes holding only the tier's files.
type freeTier struct {
	L2Tier
	t        *testing.T
	root     string
	capacity uint64
}

func (f *freeTier) FreeBytes() (uint64, error) {
	used, _ := diskUse(f.t, f.root)
	if used > f.capacity {
		return 0, nil
	}
	return f.capacity - used, nil
}

// TestL2FreeFloorHolds (issue 15.2): with a free-space floor (and no
// bound), a long store stream evicts least recently used objects so the
// file system keeps at least the floor free, without a failed store.
func TestL2FreeFloorHolds(t *testing.T) {
	dev := openDevice(t, "")
	const n = 40
	r := newRig(t, dev, c1Spec(), []int64{int64(2*n + 8)})
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	const capacity, floor = 1 << 20, 800 << 10 // room for 5 objects of 42 KB
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2 = &freeTier{L2Tier: ft, t: t, root: root, capacity: capacity}
	cfg.L2FreeFloorBytes = floor
	cfg.L2Writers = 1 // the floor does not count other writers' files in flight
	e := newEngine(t, cfg)
	r.register(e)
	for i := range n {
		c := r.newChunk(i, r.consecutiveN(i))
		res := storeAll(t, e, r, fmt.Sprintf("prompt-%d", i), c) // a stream of prompts
		if res.Objects[0].Status != Stored {
			t.Fatalf("store %d: %+v", i, res.Objects[0])
		}
		if err := e.Flush(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if used, _ := diskUse(t, root); capacity-used < floor {
			t.Fatalf("after store %d: %d B free of %d B, floor %d B", i, capacity-used, capacity, floor)
		}
	}
	st := e.Stats()
	if st.L2Evictions == 0 || st.L2Evictions+uint64(st.L2Objects) != n {
		t.Fatalf("%d L2 evictions, %d objects left of %d", st.L2Evictions, st.L2Objects, n)
	}
}
