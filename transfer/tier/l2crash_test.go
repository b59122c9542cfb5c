package tier

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
)

// crashModel is a file system that loses what was not synced at a power
// cut (issue 11.7), as an adversarial disk may: it observes FileTier's
// changes and, at the cut, rewrites the tier's directories to what could
// be left: a directory keeps only the entries of its last fsync, a file
// keeps its current length (metadata) but only the bytes of its last
// fsync (zeros past them): a file truncated and rewritten without a sync
// holds the old bytes under the new length, a file never synced holds
// zeros.
type crashModel struct {
	dirs    map[string]*crashDir // by path
	ops     int
	cutAt   int // the op that loses power; 0: none
	cut     bool
	nextIno int
}

type crashDir struct {
	parent, name string
	cur, synced  map[string]*crashFile // entries by name
}

type crashFile struct {
	cur, synced []byte
	isDir       bool
}

var errPowerCut = errors.New("simulated power cut")

func newCrashModel(root string) *crashModel {
	m := &crashModel{dirs: map[string]*crashDir{}}
	m.dirs[root] = &crashDir{cur: map[string]*crashFile{}, synced: map[string]*crashFile{}}
	return m
}

func (m *crashModel) step() error {
	if m.cut {
		return errPowerCut
	}
	m.ops++
	if m.cutAt != 0 && m.ops >= m.cutAt {
		m.cut = true
		return errPowerCut
	}
	return nil
}

func (m *crashModel) dir(path string) *crashDir {
	d := m.dirs[path]
	if d == nil {
		panic("crash model: unknown directory " + path)
	}
	return d
}

func (m *crashModel) mkdir(parent, name string) error {
	if err := m.step(); err != nil {
		return err
	}
	m.dir(parent).cur[name] = &crashFile{isDir: true}
	m.dirs[filepath.Join(parent, name)] = &crashDir{parent: parent, name: name, cur: map[string]*crashFile{}, synced: map[string]*crashFile{}}
	return nil
}

func (m *crashModel) created(dir, name string) error {
	if err := m.step(); err != nil {
		return err
	}
	d := m.dir(dir)
	if f := d.cur[name]; f != nil {
		f.cur = nil // O_TRUNC of the same inode
		return nil
	}
	d.cur[name] = &crashFile{}
	return nil
}

func (m *crashModel) wrote(dir, name string, p []byte) error {
	if err := m.step(); err != nil {
		return err
	}
	f := m.dir(dir).cur[name]
	f.cur = append(f.cur, p...)
	return nil
}

func (m *crashModel) synced(dir, name string) error {
	if err := m.step(); err != nil {
		return err
	}
	f := m.dir(dir).cur[name]
	f.synced = append([]byte(nil), f.cur...)
	return nil
}

func (m *crashModel) renamed(dir, from, to string) error {
	if err := m.step(); err != nil {
		return err
	}
	d := m.dir(dir)
	d.cur[to] = d.cur[from]
	delete(d.cur, from)
	return nil
}

func (m *crashModel) dirSynced(dir string) error {
	if err := m.step(); err != nil {
		return err
	}
	d := m.dir(dir)
	d.synced = make(map[string]*crashFile, len(d.cur))
	for k, v := range d.cur {
		d.synced[k] = v
	}
	return nil
}

// persisted is what survives of f.
func (f *crashFile) persisted() []byte {
	out := make([]byte, len(f.cur))
	copy(out, f.synced)
	return out
}

// apply turns the directories on disk into what the power cut left.
func (m *crashModel) apply(t *testing.T) {
	t.Helper()
	for path, d := range m.dirs {
		if d.parent != "" {
			if _, ok := m.dir(d.parent).synced[d.name]; !ok {
				if err := os.RemoveAll(path); err != nil {
					t.Fatal(err)
				}
				continue
			}
		}
		ents, err := os.ReadDir(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.IsDir() {
				continue
			}
			if _, ok := d.synced[e.Name()]; !ok {
				if err := os.Remove(filepath.Join(path, e.Name())); err != nil {
					t.Fatal(err)
				}
			}
		}
		for name, f := range d.synced {
			if f.isDir {
				continue
			}
			if err := os.WriteFile(filepath.Join(path, name), f.persisted(), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// runPowerCut acknowledges five objects, then loses power in the middle
// of an overwrite of the first; it returns the acknowledged objects that
// are not intact afterwards (neither their acknowledged bytes nor, for
// the one being overwritten, the new ones).
func runPowerCut(t *testing.T, ab l2Ablation) []dcp.Key {
	root := t.TempDir()
	ft, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	m := newCrashModel(root)
	ft.obs, ft.ab = m, ab
	acked := map[dcp.Key][]byte{}
	for i := range 5 {
		o, p := testObj(20 + i)
		if err := ft.Put(t.Context(), o, p); err != nil {
			t.Fatal(err)
		}
		acked[o.Key] = p
	}
	o0, _ := testObj(20)
	newer := testutil.RandomBytes(o0.Size, 999)
	o0.Sum = checksum.Sum(newer)
	m.cutAt = m.ops + 3 // the file is created and its header written; power fails on the payload
	if err := ft.Put(t.Context(), o0, newer); !errors.Is(err, errPowerCut) {
		t.Fatalf("Put across the power cut: %v", err)
	}
	m.apply(t)

	after, err := OpenFileTier(root, nil)
	if err != nil {
		t.Fatal(err)
	}
	var lost []dcp.Key
	for key, p := range acked {
		got := make([]byte, len(p))
		_, err := after.Get(t.Context(), key, [32]byte{}, got)
		if err != nil || !(bytes.Equal(got, p) || key == o0.Key && bytes.Equal(got, newer)) {
			lost = append(lost, key)
		}
	}
	return lost
}

// TestL2PowerCutKeepsAcknowledged: every object Put acknowledged is intact
// after a power cut, also the one whose overwrite the cut interrupted.
func TestL2PowerCutKeepsAcknowledged(t *testing.T) {
	if lost := runPowerCut(t, l2Ablation{}); len(lost) != 0 {
		t.Fatalf("%d acknowledged objects lost or torn by the power cut: %v", len(lost), lost)
	}
}

// TestL2PowerCutSeesEveryMissingStep: the power-cut test goes red when any
// one of Put's durability steps is removed: the file fsync (acknowledged
// objects come back as zeros), the directory fsync (their names are
// lost), or temp + rename (the interrupted overwrite tears the old
// object).
func TestL2PowerCutSeesEveryMissingStep(t *testing.T) {
	for name, ab := range map[string]l2Ablation{
		"no file fsync":      {noFileSync: true},
		"no directory fsync": {noDirSync: true},
		"no temp + rename":   {noRename: true},
	} {
		t.Run(name, func(t *testing.T) {
			if lost := runPowerCut(t, ab); len(lost) == 0 {
				t.Fatalf("with %s the power cut lost nothing: the test cannot see that step", name)
			}
		})
	}
}
