package powercut

import (
	"bytes"
	"math/rand/v2"
	"syscall"
	"testing"
)

// The model's rules, without FUSE (these run everywhere).

func mustAdd(t *testing.T, m *model, g *generation, parent uint64, name string, dir bool) uint64 {
	t.Helper()
	a, e := m.add(g, parent, name, dir, 0o600, 0, 0)
	if e != 0 {
		t.Fatalf("add %s: %v", name, e)
	}
	return a.ino
}

func mustOK(t *testing.T, what string, e syscall.Errno) {
	t.Helper()
	if e != 0 {
		t.Fatalf("%s: %v", what, e)
	}
}

func mustWrite(t *testing.T, m *model, g *generation, ino uint64, off int64, p string) {
	t.Helper()
	_, e := m.write(g, ino, off, []byte(p))
	mustOK(t, "write", e)
}

// readName returns the content of name in the root, or the lookup error.
func readName(t *testing.T, m *model, g *generation, name string) (string, syscall.Errno) {
	t.Helper()
	a, e := m.lookup(g, rootIno, name)
	if e != 0 {
		return "", e
	}
	b, e := m.read(g, a.ino, 0, 1<<20)
	mustOK(t, "read", e)
	return string(b), 0
}

func TestModelFileSyncAndDirSync(t *testing.T) {
	for _, tc := range []struct {
		name              string
		syncFile, syncDir bool
		want              string
		wantErr           syscall.Errno
	}{
		{"both synced: survives", true, true, "hello", 0},
		{"file synced, name not: gone", true, false, "", syscall.ENOENT},
		{"name synced, bytes not: zeros", false, true, "\x00\x00\x00\x00\x00", 0},
		{"nothing synced: gone", false, false, "", syscall.ENOENT},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newModel(0, 0)
			g := m.gen
			f := mustAdd(t, m, g, rootIno, "f", false)
			mustWrite(t, m, g, f, 0, "hello")
			if got, _ := readName(t, m, g, "f"); got != "hello" {
				t.Fatalf("running view reads %q, want the unsynced %q", got, "hello")
			}
			if tc.syncFile {
				mustOK(t, "fsync file", m.fsync(g, f))
			}
			if tc.syncDir {
				mustOK(t, "fsync dir", m.fsync(g, rootIno))
			}
			g = m.crash()
			got, e := readName(t, m, g, "f")
			if got != tc.want || e != tc.wantErr {
				t.Fatalf("after crash: %q, %v; want %q, %v", got, e, tc.want, tc.wantErr)
			}
		})
	}
}

// An unsynced overwrite and truncate leave the synced bytes, cut at the
// size the file had (a size can reach the disk without the data).
func TestModelUnsyncedOverwriteAndTruncate(t *testing.T) {
	m := newModel(0, 0)
	g := m.gen
	f := mustAdd(t, m, g, rootIno, "f", false)
	mustWrite(t, m, g, f, 0, "0123456789")
	mustOK(t, "fsync", m.fsync(g, f))
	mustOK(t, "fsync dir", m.fsync(g, rootIno))
	mustWrite(t, m, g, f, 2, "xx")
	size := int64(4)
	_, e := m.setattr(g, f, &size, nil, nil, nil, nil)
	mustOK(t, "truncate", e)
	if got, _ := readName(t, m, g, "f"); got != "01xx" {
		t.Fatalf("running view %q, want %q", got, "01xx")
	}
	g = m.crash()
	if got, _ := readName(t, m, g, "f"); got != "0123" {
		t.Fatalf("after crash %q, want the synced bytes at the size of the cut %q", got, "0123")
	}
	// Grown without a sync: zeros past the synced bytes.
	mustWrite(t, m, g, f, 6, "zz")
	g = m.crash()
	if got, _ := readName(t, m, g, "f"); got != "0123\x00\x00\x00\x00" {
		t.Fatalf("after crash %q, want %q", got, "0123\x00\x00\x00\x00")
	}
}

func TestModelRenameNeedsDirSync(t *testing.T) {
	m := newModel(0, 0)
	g := m.gen
	old := mustAdd(t, m, g, rootIno, "final", false)
	mustWrite(t, m, g, old, 0, "old")
	mustOK(t, "fsync", m.fsync(g, old))
	mustOK(t, "fsync dir", m.fsync(g, rootIno))
	tmp := mustAdd(t, m, g, rootIno, "final.tmp", false)
	mustWrite(t, m, g, tmp, 0, "new")
	mustOK(t, "fsync tmp", m.fsync(g, tmp))
	mustOK(t, "rename", m.rename(g, rootIno, "final.tmp", rootIno, "final", 0))
	g2 := m.crash()
	if got, _ := readName(t, m, g2, "final"); got != "old" {
		t.Fatalf("rename without directory fsync: after crash final = %q, want %q", got, "old")
	}
	if _, e := readName(t, m, g2, "final.tmp"); e != syscall.ENOENT {
		t.Fatalf("the temp name was never durable; after crash: %v", e)
	}
	// The same with the directory synced after the rename.
	tmp = mustAdd(t, m, g2, rootIno, "final.tmp", false)
	mustWrite(t, m, g2, tmp, 0, "new")
	mustOK(t, "fsync tmp", m.fsync(g2, tmp))
	mustOK(t, "rename", m.rename(g2, rootIno, "final.tmp", rootIno, "final", 0))
	mustOK(t, "fsync dir", m.fsync(g2, rootIno))
	g3 := m.crash()
	if got, _ := readName(t, m, g3, "final"); got != "new" {
		t.Fatalf("rename with directory fsync: after crash final = %q, want %q", got, "new")
	}
}

func TestModelCrossDirectoryRename(t *testing.T) {
	setup := func(t *testing.T) (*model, *generation, uint64, uint64) {
		m := newModel(0, 0)
		g := m.gen
		a := mustAdd(t, m, g, rootIno, "a", true)
		b := mustAdd(t, m, g, rootIno, "b", true)
		f := mustAdd(t, m, g, a, "f", false)
		mustWrite(t, m, g, f, 0, "x")
		mustOK(t, "fsync f", m.fsync(g, f))
		mustOK(t, "fsync a", m.fsync(g, a))
		mustOK(t, "fsync b", m.fsync(g, b))
		mustOK(t, "fsync root", m.fsync(g, rootIno))
		mustOK(t, "rename", m.rename(g, a, "f", b, "f", 0))
		return m, g, a, b
	}
	names := func(m *model, g *generation) (inA, inB bool) {
		a, _ := m.lookup(g, rootIno, "a")
		b, _ := m.lookup(g, rootIno, "b")
		_, ea := m.lookup(g, a.ino, "f")
		_, eb := m.lookup(g, b.ino, "f")
		return ea == 0, eb == 0
	}
	t.Run("target synced: both names", func(t *testing.T) {
		m, g, _, b := setup(t)
		mustOK(t, "fsync b", m.fsync(g, b))
		if inA, inB := names(m, m.crash()); !inA || !inB {
			t.Fatalf("after crash f in a: %v, in b: %v; want both", inA, inB)
		}
	})
	t.Run("source synced: neither", func(t *testing.T) {
		m, g, a, _ := setup(t)
		mustOK(t, "fsync a", m.fsync(g, a))
		if inA, inB := names(m, m.crash()); inA || inB {
			t.Fatalf("after crash f in a: %v, in b: %v; want neither", inA, inB)
		}
	})
	t.Run("a directory cannot change parent", func(t *testing.T) {
		m, g, a, b := setup(t)
		mustAdd(t, m, g, a, "d", true)
		if e := m.rename(g, a, "d", b, "d", 0); e != syscall.EXDEV {
			t.Fatalf("directory renamed to another parent: %v, want EXDEV", e)
		}
		mustOK(t, "rename within parent", m.rename(g, a, "d", a, "e", 0))
	})
}

func TestModelCutFailsEveryLaterMutation(t *testing.T) {
	m := newModel(0, 0)
	g := m.gen
	f := mustAdd(t, m, g, rootIno, "f", false)
	mustOK(t, "fsync dir", m.fsync(g, rootIno))
	m.cutAfter(2)
	mustWrite(t, m, g, f, 0, "a")
	mustWrite(t, m, g, f, 1, "b")
	if _, e := m.write(g, f, 2, []byte("c")); e != syscall.EIO {
		t.Fatalf("third write after cutAfter(2): %v, want EIO", e)
	}
	if e := m.fsync(g, f); e != syscall.EIO {
		t.Fatalf("fsync after the cut: %v, want EIO", e)
	}
	if _, e := m.add(g, rootIno, "g", false, 0o600, 0, 0); e != syscall.EIO {
		t.Fatalf("create after the cut: %v, want EIO", e)
	}
	if got, _ := readName(t, m, g, "f"); got != "ab" {
		t.Fatalf("reads after the cut see %q, want the state at the cut %q", got, "ab")
	}
	if _, cut := m.state(); !cut {
		t.Fatal("state does not report the cut")
	}
	g = m.crash()
	if got, _ := readName(t, m, g, "f"); got != "\x00\x00" {
		t.Fatalf("after crash %q, want two zeros (the size, not the bytes)", got)
	}
	mustWrite(t, m, g, f, 0, "z") // the new generation has power
}

// TestModelPagesMatchAReference drives random writes, truncates and
// fsyncs on one file across page boundaries and checks the running bytes
// against a plain slice, and the bytes after each crash against the slice
// as of the last fsync, at the size the file had at the crash.
func TestModelPagesMatchAReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	m := newModel(0, 0)
	g := m.gen
	f := mustAdd(t, m, g, rootIno, "f", false)
	mustOK(t, "fsync dir", m.fsync(g, rootIno))
	var cur, durable []byte
	for step := range 3000 {
		switch r := rng.IntN(20); {
		case r < 12:
			off := rng.IntN(5 * pageSize)
			p := make([]byte, 1+rng.IntN(2*pageSize))
			for i := range p {
				p[i] = byte(rng.IntN(255) + 1)
			}
			mustWrite(t, m, g, f, int64(off), string(p))
			if off+len(p) > len(cur) {
				cur = append(cur, make([]byte, off+len(p)-len(cur))...)
			}
			copy(cur[off:], p)
		case r < 15:
			size := rng.IntN(6 * pageSize)
			s := int64(size)
			_, e := m.setattr(g, f, &s, nil, nil, nil, nil)
			mustOK(t, "truncate", e)
			if size < len(cur) {
				cur = cur[:size]
			} else {
				cur = append(cur, make([]byte, size-len(cur))...)
			}
		case r < 18:
			mustOK(t, "fsync", m.fsync(g, f))
			durable = bytes.Clone(cur)
		default:
			g = m.crash()
			next := make([]byte, len(cur))
			copy(next, durable)
			cur, durable = next, bytes.Clone(next) // what the disk holds now
		}
		got, _ := readName(t, m, g, "f")
		if !bytes.Equal([]byte(got), cur) {
			t.Fatalf("step %d: file holds %d B, reference %d B (first difference at %d)", step, len(got), len(cur), firstDiff([]byte(got), cur))
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
