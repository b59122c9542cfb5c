package transfer

import (
	"bytes"
	"context"
	"io"
	"sync/atomic"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// rewriteAfterRead runs rewrite once, as soon as a reader has read the
// whole of object name (before it can act on what it read): the writer
// rewriting the object in the window between a reader's read and what
// the reader does next.
type rewriteAfterRead struct {
	ObjectStore
	name    string
	rewrite func()
	done    atomic.Bool
}

func (s *rewriteAfterRead) Open(ctx context.Context, name string, off, n int64) (io.ReadCloser, int64, error) {
	body, size, err := s.ObjectStore.Open(ctx, name, off, n)
	if err != nil || name != s.name || off != 0 || n != 0 {
		return body, size, err
	}
	return &hookedBody{ReadCloser: body, left: size, at: func() {
		if s.done.CompareAndSwap(false, true) {
			s.rewrite()
		}
	}}, size, nil
}

type hookedBody struct {
	io.ReadCloser
	left int64
	at   func()
}

func (b *hookedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	if b.left <= 0 && n > 0 {
		b.at()
	}
	return n, err
}

// TestL3ReaderNeverDeletesTheWritersObject (issue 29.5): MLA at TP 2: rank
// 0 writes the objects, rank 1 reads them from the shared bucket. Rank 1
// reads a damaged copy of rank 0's object; right after its read rank 0
// rewrites a valid copy. Rank 1 fails the chunk (corrupt, nothing written
// into its pages) but leaves the object to its writer: the valid copy
// stays in the bucket, where rank 0's inventory still announces it, and
// restores from it. Seen red before the fix: rank 1 deleted the object it
// found bad, which by then was the valid rewrite (the bucket read gave not
// found while rank 0 listed its L3 copy).
func TestL3ReaderNeverDeletesTheWritersObject(t *testing.T) {
	dev := openDevice(t, "")
	spec := c1Spec()
	spec.Layout = dcp.Layout{TP: 2, DCP: 1, Interleave: 1, PP: 1}
	r0 := newRig(t, dev, spec, []int64{8})
	r1 := newRig(t, dev, spec, []int64{8})
	l3, _ := openL3(t)
	cfg0 := engineConfig(t, dev, 0, 2)
	cfg0.L2Dir, cfg0.L3 = t.TempDir(), l3
	e0 := newEngine(t, cfg0)
	r0.register(e0)
	c := r0.newChunk(0, r0.consecutiveN(0))
	storeAll(t, e0, r0, "s", c)
	if err := e0.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	key := keyOf(r0, c, 0)
	name := NewL3Tier(l3, cfg0.Rank.Instance, nil).Name(key)
	body, _, err := l3.Open(testCtx(t), name, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	good, err := io.ReadAll(body)
	body.Close()
	if err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(good)
	bad[len(bad)-3] ^= 0x10
	if err := l3.Put(testCtx(t), name, bytes.NewReader(bad), int64(len(bad))); err != nil {
		t.Fatal(err)
	}

	// Rank 1: its own (empty) L2 root, the bucket through the hook.
	hook := &rewriteAfterRead{ObjectStore: l3, name: name, rewrite: func() {
		if err := l3.Put(context.Background(), name, bytes.NewReader(good), int64(len(good))); err != nil {
			t.Error(err)
		}
	}}
	cfg1 := engineConfig(t, dev, 1, 2)
	cfg1.L2Dir, cfg1.L3 = t.TempDir(), hook
	e1 := newEngine(t, cfg1)
	r1.register(e1)
	tgt := r1.consecutiveN(2)
	rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{tgt}))
	if err != nil {
		t.Fatal(err)
	}
	if !hook.done.Load() {
		t.Fatal("rank 1 never read the object from the bucket")
	}
	if rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
		t.Fatalf("rank 1 read of the damaged copy: %+v, want failed as corrupt", rr.Items[0])
	}
	r1.check("rank 1's pools after the damaged read: nothing written")
	if tierCount(e0.Inventory(), wire.L3) != 1 {
		t.Fatal("rank 0 no longer lists its L3 copy")
	}
	if err := l3Holds(t, l3, r0, key, c.packed[0]); err != nil {
		t.Fatalf("rank 0 lists its L3 copy; the bucket says %v (a reader deleted the writer's rewrite)", err)
	}
	if got := testutil.Metric(t, gatherer(t, e1), "kvtier_transfer_l3_left_for_writer_total"); got != 1 {
		t.Fatalf("l3_left_for_writer_total on rank 1 = %v, want 1", got)
	}
	// Rank 1 restores from the rewritten copy.
	rr, err = e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{tgt}))
	if err != nil || !rr.ChunkOK(0) || rr.Items[0].From != wire.L3 {
		t.Fatalf("rank 1 retrieve of the rewritten copy: %+v %v", rr, err)
	}
	r1.expectRestored(c, tgt)
	r1.check("rank 1 after restoring the rewritten copy")
}

// TestL3WriterKeepsACopyRewrittenSinceItsRead: the writer itself reads a
// damaged copy of its object (L1 and L2 lost it), and its own write of
// the object lands between that read and the repair. The repair sees the
// write and keeps the new copy: the bucket holds it and the inventory
// lists it. Seen red with the repair's since-the-read check removed: the
// writer deleted its fresh copy and announced its removal.
func TestL3WriterKeepsACopyRewrittenSinceItsRead(t *testing.T) {
	dev := openDevice(t, "")
	r := newRig(t, dev, c1Spec(), []int64{8})
	l3, _ := openL3(t)
	root := t.TempDir()
	cfg := engineConfig(t, dev, 0, 1)
	cfg.L2Dir, cfg.L3 = root, l3
	e1 := newEngine(t, cfg)
	r.register(e1)
	c := r.newChunk(0, r.consecutiveN(0))
	storeAll(t, e1, r, "s", c)
	if err := e1.FlushL3(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	closeEngine(t, e1)
	wipe(t, root)
	key := keyOf(r, c, 0)
	name := NewL3Tier(l3, cfg.Rank.Instance, nil).Name(key)
	body, _, err := l3.Open(testCtx(t), name, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	good, err := io.ReadAll(body)
	body.Close()
	if err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(good)
	bad[len(bad)-3] ^= 0x10
	if err := l3.Put(testCtx(t), name, bytes.NewReader(bad), int64(len(bad))); err != nil {
		t.Fatal(err)
	}

	var e2 *Engine
	hook := &rewriteAfterRead{ObjectStore: l3, name: name, rewrite: func() {
		// What the writer's write of the object does: the PUT, then its
		// inventory entry.
		if err := l3.Put(context.Background(), name, bytes.NewReader(good), int64(len(good))); err != nil {
			t.Error(err)
		}
		e2.mu.Lock()
		e2.l3SetLocked(key, l2Entry{size: uint64(len(c.packed[0])), sum: checksum.Sum(c.packed[0]), fp: r.res.Fingerprint}, 0)
		e2.mu.Unlock()
	}}
	c2 := cfg
	c2.L3, c2.Registerer = hook, newRegistry()
	e2 = newEngine(t, c2)
	if err := e2.WaitL3Scan(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	r.register(e2)
	rr, err := e2.Retrieve(testCtx(t), r.retrieveReq(0, []chunk{c}, [][][]int64{r.consecutiveN(2)}))
	if err != nil {
		t.Fatal(err)
	}
	if !hook.done.Load() || rr.ChunkOK(0) || rr.Items[0].Reason != ReasonCorrupt {
		t.Fatalf("the writer's read of the damaged copy: %+v (read %v), want failed as corrupt", rr.Items[0], hook.done.Load())
	}
	r.check("after the damaged read: nothing written")
	if err := l3Holds(t, l3, r, key, c.packed[0]); err != nil {
		t.Fatalf("the bucket after the repair: %v; want the copy written since the read", err)
	}
	if tierCount(e2.Inventory(), wire.L3) != 1 {
		t.Fatal("the writer dropped the copy written since its read")
	}
}
