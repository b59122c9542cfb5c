package rankd

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

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
