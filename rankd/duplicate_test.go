package rankd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// fileState is what a refused duplicate must leave as it was.
type fileState struct {
	mode  fs.FileMode
	mtime time.Time
	data  []byte // regular files
}

// snapshotTree records every entry under root (itself included).
func snapshotTree(t *testing.T, root string) map[string]fileState {
	t.Helper()
	out := map[string]fileState{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fileState{mode: fi.Mode(), mtime: fi.ModTime()}
		if fi.Mode().IsRegular() {
			if st.data, err = os.ReadFile(p); err != nil {
				return err
			}
		}
		rel, _ := filepath.Rel(root, p)
		out[rel] = st
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffTrees(before, after map[string]fileState) []string {
	var diffs []string
	for p, b := range before {
		a, ok := after[p]
		if !ok {
			diffs = append(diffs, fmt.Sprintf("%s: removed", p))
			continue
		}
		if a.mode != b.mode {
			diffs = append(diffs, fmt.Sprintf("%s: mode %v, was %v", p, a.mode, b.mode))
		}
		if !a.mtime.Equal(b.mtime) {
			diffs = append(diffs, fmt.Sprintf("%s: mtime %v, was %v", p, a.mtime, b.mtime))
		}
		if !bytes.Equal(a.data, b.data) {
			diffs = append(diffs, fmt.Sprintf("%s: content %q, was %q", p, a.data, b.data))
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("%s: created", p))
		}
	}
	sort.Strings(diffs)
	return diffs
}

// TestRefusedDuplicateTouchesNoFiles (issue 18.3 follow-up): a second
// rankd for a live rank, on the live rank's L2 directory, is refused with
// ErrDuplicateRank and leaves that directory (the incarnation file and
// the L2 objects) byte-identical, mtimes included. On the unfixed code
// New bumped the stored incarnation before Start's duplicate check (seen
// failing: incarnations/eng.1: content "1796128879330225652\n", was
// "1796128879298731329\n", its mtime and the incarnations directory's
// changed).
func TestRefusedDuplicateTouchesNoFiles(t *testing.T) {
	h := newHarness(t) // write-through: the stored chunk reaches L2
	e, reg := newStoringEngine(t, h)
	ctx := h.ctx()
	for l, m := range e.pools {
		if err := e.dev.Write(m, 0, pageOf(l, 0, e.g.PageBytes)); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := e.dev.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Release()
	s, err := e.dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Record(ev); err != nil {
		t.Fatal(err)
	}
	evh, err := e.dev.ExportEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	chunk := dcp.ChunkHashes(e.res.Namespace, make([]uint32, 16), 16)[0]
	st, err := bus.Call[wire.StoreReply](ctx, h.nc, h.subj.Engine(h.rank, OpStore), wire.StoreRequest{
		RequestID: "r", Namespace: e.res.Namespace, Session: reg.Session, Event: evh,
		Chunks: []wire.ChunkBlocks{{Chunk: chunk, Blocks: [][]int64{{0}}}}})
	if err != nil || st.Stored != 1 {
		t.Fatalf("store: %+v %v", st, err)
	}
	if err := h.d.Engine().Flush(ctx); err != nil { // its L2 write has landed
		t.Fatal(err)
	}
	if n := h.d.Engine().Stats().L2Objects; n != 1 {
		t.Fatalf("%d objects in L2, want 1", n)
	}
	before := snapshotTree(t, h.cfg.L2Dir)
	if _, ok := before[filepath.Join("incarnations", "eng.1")]; !ok {
		t.Fatalf("no incarnation file in the live rank's L2 directory: %v", before)
	}

	cfg := h.cfg
	cfg.NodeName = "duplicate"
	cfg.Join = []string{h.d.GossipAddr()}
	cfg.DuplicateWait = 300 * time.Millisecond
	cfg.Host = cuda.HostConfig{Dir: t.TempDir(), UUID: "HOST-rankd-duplicate"}
	if err := os.Chmod(cfg.Host.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	cfg.Logger = zaptest.NewLogger(t)
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = d2.Start(sctx)
	if sderr := d2.Shutdown(context.Background()); sderr != nil {
		t.Logf("shutdown of the refused duplicate: %v", sderr)
	}
	if !errors.Is(err, ErrDuplicateRank) {
		t.Fatalf("Start of the duplicate = %v, want ErrDuplicateRank", err)
	}
	if diffs := diffTrees(before, snapshotTree(t, h.cfg.L2Dir)); len(diffs) > 0 {
		t.Fatalf("the refused duplicate changed the live rank's L2 directory:\n%s", joinLines(diffs))
	}
}

func joinLines(s []string) string {
	var b bytes.Buffer
	for _, l := range s {
		b.WriteString("  " + l + "\n")
	}
	return b.String()
}
