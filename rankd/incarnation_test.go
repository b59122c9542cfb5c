package rankd

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

func TestNextIncarnationSurvivesAClockBehind(t *testing.T) {
	dir := t.TempDir()
	r := wire.Rank{Instance: "eng", TPRank: 2}
	a, err := nextIncarnation(dir, r)
	if err != nil {
		t.Fatal(err)
	}
	b, err := nextIncarnation(dir, r)
	if err != nil || b <= a {
		t.Fatalf("second start: %d (%v), want > %d", b, err, a)
	}
	// The clock steps far back (or the rank moves to a host behind): the
	// kept incarnation still orders the next start after it.
	future := uint64(1) << 63
	path := filepath.Join(dir, "incarnations", "eng.2")
	if err := os.WriteFile(path, []byte(strconv.FormatUint(future, 10)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := nextIncarnation(dir, r)
	if err != nil || c != future+1 {
		t.Fatalf("after a clock step back: %d (%v), want %d", c, err, future+1)
	}
	// Other ranks of the instance keep their own.
	if o, err := nextIncarnation(dir, wire.Rank{Instance: "eng", TPRank: 3}); err != nil || o >= future {
		t.Fatalf("rank 3: %d (%v)", o, err)
	}
	// A damaged file is a clear error, not a silent restart from the clock.
	if err := os.WriteFile(path, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := nextIncarnation(dir, r); err == nil {
		t.Fatal("a damaged incarnation file was accepted")
	}
	// Without L2 the clock decides.
	if x, err := nextIncarnation("", r); err != nil || x == 0 {
		t.Fatalf("no L2: %d %v", x, err)
	}
}

// TestPeekIncarnationWritesNothing: the peek New does reads only; the save
// Start does after the duplicate check refuses an incarnation another
// start of the rank overtook in between, naming both numbers, and leaves
// the stored one as it was.
func TestPeekIncarnationWritesNothing(t *testing.T) {
	dir := t.TempDir()
	r := wire.Rank{Instance: "eng", TPRank: 2}
	inc, err := peekIncarnation(dir, r)
	if err != nil || inc == 0 {
		t.Fatalf("peek: %d %v", inc, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "incarnations")); !os.IsNotExist(err) {
		t.Fatalf("peek created the incarnation directory (stat: %v)", err)
	}
	// Another start of the rank stores a later one first.
	other := inc + 10
	if err := saveIncarnation(dir, r, other); err != nil {
		t.Fatal(err)
	}
	err = saveIncarnation(dir, r, inc)
	if !errors.Is(err, ErrDuplicateRank) || !strings.Contains(err.Error(), "holds "+strconv.FormatUint(other, 10)) ||
		!strings.Contains(err.Error(), "this start's "+strconv.FormatUint(inc, 10)) {
		t.Fatalf("save of an overtaken incarnation = %v, want ErrDuplicateRank naming %d and %d", err, other, inc)
	}
	b, err := os.ReadFile(filepath.Join(dir, "incarnations", "eng.2"))
	if err != nil || string(b) != strconv.FormatUint(other, 10)+"\n" {
		t.Fatalf("stored incarnation %q (%v), want %d", b, err, other)
	}
	if next, err := peekIncarnation(dir, r); err != nil || next <= other {
		t.Fatalf("peek after: %d %v, want > %d", next, err, other)
	}
}

// TestStartsWhileIncarnationUnwritable (campaign finding: a rankd whose L2
// file system was full exited 1 at start, "write incarnation file: no
// space left on device"): a failing L2 must not keep the rank from serving
// L1 (issue 11.3). The temp name of the incarnation file is taken by a
// directory, so its write fails (as under ENOSPC, without root); the rank
// starts with the incarnation it drew, counts and logs the failure, stores
// a chunk, and stores its incarnation once the write succeeds again.
func TestStartsWhileIncarnationUnwritable(t *testing.T) {
	l2 := t.TempDir()
	blocker := filepath.Join(l2, "incarnations", "eng.1.tmp")
	if err := os.MkdirAll(blocker, 0o700); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(c *Config) { c.L2Dir = l2 })
	path := filepath.Join(l2, "incarnations", "eng.1")
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("incarnation file written although its temp name is a directory (stat: %v)", err)
	}
	if v := testutil.Metric(t, h.d.met.reg, "kvtier_rankd_incarnation_save_failures_total"); v < 1 {
		t.Fatalf("incarnation_save_failures_total = %v, want >= 1", v)
	}
	// It serves: a register and a store of a non-MLA chunk (rank 1 stores
	// its own shard) are answered, the object committed.
	e, reg := newStoringEngine(t, h)
	st, err := e.storeFirstChunk(t, h, reg.Session)
	if err != nil || st.Stored != 1 || len(st.Failed) != 0 {
		t.Fatalf("store while the incarnation is unsaved: %+v %v, want 1 stored", st, err)
	}
	// The L2 heals: the incarnation is stored (retried every heartbeat).
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	want := strconv.FormatUint(h.d.inc, 10) + "\n"
	deadline := time.Now().Add(15 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil && string(b) == want {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("incarnation file %q (%v) 15 s after the L2 healed, want %q", b, err, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
