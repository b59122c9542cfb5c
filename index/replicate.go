package index

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"
)

// This file is what a replicated coordinator (coordinator/raft.go) needs of
// the index: requests that carry the raft log index they were committed at,
// so the index applies each exactly once across restarts; a consistent
// snapshot of the whole bbolt file; installing such a snapshot; and a
// canonical dump of the state that two replicas can compare byte for byte.
//
// Exactly once: the highest raft index applied is kept in the meta bucket
// ("raft_applied", 8 B big-endian) and written in the same bbolt
// transaction as the group commit that applied it. A replicated request
// whose raft index is <= the highest one staged is skipped (not applied,
// Result.Skipped): raft replays the log after its last snapshot when a node
// restarts, and the index may already hold those entries.

var keyApplied = []byte("raft_applied")

// Op is one replicated request: exactly one of its request fields is set.
type Op struct {
	// RaftIndex is the raft log index of the entry; > 0.
	RaftIndex uint64

	Batch     *wire.Batch
	Inventory *wire.Inventory
	// FenceGen, when not nil, is the rank's fence generation Inventory
	// was requested under (ApplyInventoryAt); nil applies it whatever
	// fences came since (ApplyInventory; entries of older leaders).
	FenceGen *uint64
	// Fence fences FenceRank (FenceRank's rank and upTo).
	Fence *wire.Rank
	UpTo  uint64
	// Register registers a namespace (RegisterNamespace's spec).
	Register *dcp.Spec
	// Reset resets a rank (ResetRank).
	Reset *wire.Rank
	// Step is one step of a streamed inventory (ApplyInventoryStep): each
	// page its own entry, of bounded size.
	Step *InventoryStep
}

// Result is what a replicated request did; the field of its kind is set.
type Result struct {
	// Skipped: the index had applied this raft index already (a replay
	// after a restart); nothing was done.
	Skipped   bool
	Outcome   Outcome          // Batch
	Inventory InventoryOutcome // Inventory, Step
	// Fenced is the placements fenced (Fence) or dropped (Reset).
	Fenced int
	// Spec is the namespace's registered spec (Register).
	Spec *dcp.Resolved
	// Err is the request's error (ErrInvalid, ErrNamespaceConflict,
	// ErrUnknownRank, ErrFailed, ...).
	Err error
}

// ApplyReplicated queues a replicated request like ApplyAsync; requests
// are applied in the order ApplyReplicated returns, which must be the raft
// log order. Wait on the Pending's Result. The request is validated here;
// an invalid one gets a Pending whose Result has the error (every replica
// refuses it alike).
func (ix *Index) ApplyReplicated(ctx context.Context, op Op) (*Pending, error) {
	if op.RaftIndex == 0 {
		return nil, fmt.Errorf("replicated request without a raft index: %w", ErrInvalid)
	}
	r := &request{raftIndex: op.RaftIndex, n: 1}
	var verr error
	switch {
	case op.Batch != nil:
		r.kind, r.batch, r.n = reqBatch, op.Batch, len(op.Batch.Events)
		verr = validateBatch(op.Batch)
	case op.Inventory != nil:
		r.kind, r.inv, r.n = reqInventory, op.Inventory, len(op.Inventory.Objects)+1
		if op.FenceGen != nil {
			r.fenceGen, r.genChecked = *op.FenceGen, true
		}
		verr = validateInventory(op.Inventory)
	case op.Step != nil:
		r.kind, r.step, r.n = reqInvStep, op.Step, len(op.Step.Objects)+1
		verr = validateStep(op.Step)
	case op.Fence != nil:
		r.kind, r.rank, r.upTo = reqFence, *op.Fence, op.UpTo
		if err := validateRank(*op.Fence); err != nil {
			verr = fmt.Errorf("fence: %w", err)
		}
	case op.Reset != nil:
		r.kind, r.rank = reqReset, *op.Reset
		if err := validateRank(*op.Reset); err != nil {
			verr = fmt.Errorf("reset: %w", err)
		}
	case op.Register != nil:
		r.kind = reqRegister
		res, err := op.Register.Resolve()
		if err != nil {
			verr = fmt.Errorf("register namespace: %w: %w", ErrInvalid, err)
			break
		}
		js, err := json.Marshal(op.Register)
		if err != nil {
			verr = fmt.Errorf("register namespace: encode spec: %w: %w", ErrInvalid, err)
			break
		}
		r.spec, r.json = res, js
	default:
		return nil, fmt.Errorf("replicated request %d names no operation: %w", op.RaftIndex, ErrInvalid)
	}
	if verr != nil {
		// Still through the committer, so the raft index is recorded in
		// order with the others (an entry refused alike on every replica).
		r.kind, r.err = reqSkip, verr
	}
	if err := ix.enqueue(ctx, r); err != nil {
		return nil, err
	}
	return &Pending{r: r}, nil
}

// Result waits for the request and returns what it did.
func (p *Pending) Result(ix *Index) Result {
	<-p.r.done
	r := p.r
	res := Result{Skipped: r.skipped, Err: r.err}
	if r.skipped {
		return res
	}
	switch r.kind {
	case reqBatch:
		res.Outcome = r.out
	case reqInventory, reqInvStep:
		res.Inventory = r.invOut
	case reqFence:
		res.Fenced = max(r.fenced, 0)
	case reqReset:
		if r.fenced == fenceUnknown && res.Err == nil {
			res.Err = fmt.Errorf("reset rank %s: %w", r.rank, ErrUnknownRank)
		}
		res.Fenced = max(r.fenced, 0)
	case reqRegister:
		if res.Err == nil {
			ix.mu.RLock()
			if n := ix.st.ns[r.spec.Namespace]; n != nil {
				res.Spec = n.spec
			}
			ix.mu.RUnlock()
		}
	}
	return res
}

// AppliedIndex is the highest raft index committed to bbolt and published
// (0 when the index was never replicated).
func (ix *Index) AppliedIndex() uint64 { return ix.appliedPub.Load() }

// Sync returns once everything queued before it (sliced fences and
// inventories included) is committed and visible to lookups. A new raft
// leader calls it after its barrier: raft's barrier only says the entries
// were queued here.
func (ix *Index) Sync(ctx context.Context) error {
	return ix.submit(ctx, &request{kind: reqSync, n: 1})
}

// stageReplicated decides whether a replicated request is applied: false
// when its raft index was applied already (r is answered as skipped).
// Committer only.
func (ix *Index) stageReplicated(r *request) bool {
	if r.raftIndex <= ix.applied {
		r.skipped = true
		ix.met.raftSkipped.Inc()
		close(r.done)
		return false
	}
	ix.applied = r.raftIndex
	ix.staging().raftIndex = r.raftIndex
	return true
}

// snapshotMagic starts a snapshot stream: magic, the raft index the
// snapshot holds (8 B big-endian), the bbolt file's length (8 B), the file.
var snapshotMagic = [8]byte{'k', 'v', 't', 'i', 'x', 's', 'n', '1'}

// Snapshot is a consistent, read-only view of the whole index file, taken
// between two group commits. While it is open, commits that must grow
// bbolt's memory map wait for it (Config.InitialMmapSize avoids most).
// Release it when done.
type Snapshot struct {
	tx      *bolt.Tx
	applied uint64
}

// RaftIndex is the highest raft index the snapshot holds.
func (s *Snapshot) RaftIndex() uint64 { return s.applied }

// WriteTo writes the snapshot stream: a header, then the bbolt file.
func (s *Snapshot) WriteTo(w io.Writer) (int64, error) {
	var h [24]byte
	copy(h[:8], snapshotMagic[:])
	binary.BigEndian.PutUint64(h[8:16], s.applied)
	binary.BigEndian.PutUint64(h[16:24], uint64(s.tx.Size()))
	n, err := w.Write(h[:])
	if err != nil {
		return int64(n), fmt.Errorf("write snapshot header: %w: %w", ErrStore, err)
	}
	m, err := s.tx.WriteTo(w)
	if err != nil {
		return int64(n) + m, fmt.Errorf("write snapshot of %d B: %w: %w", s.tx.Size(), ErrStore, err)
	}
	return int64(n) + m, nil
}

// Release ends the snapshot's read transaction; idempotent.
func (s *Snapshot) Release() {
	if s.tx != nil {
		_ = s.tx.Rollback()
		s.tx = nil
	}
}

// Snapshot takes a snapshot at a barrier: everything queued before the
// call is committed and in it.
func (ix *Index) Snapshot(ctx context.Context) (*Snapshot, error) {
	r := &request{kind: reqSnapshot, n: 1}
	if err := ix.submit(ctx, r); err != nil {
		return nil, err
	}
	return r.snap, nil
}

// takeSnapshot answers a snapshot request; committer only, at a barrier.
func (ix *Index) takeSnapshot(r *request) {
	tx, err := ix.db.Begin(false)
	if err != nil {
		r.err = fmt.Errorf("snapshot: begin read transaction: %w: %w", ErrStore, err)
		return
	}
	r.snap = &Snapshot{tx: tx, applied: ix.applied}
}

// Restore installs a snapshot stream written by Snapshot.WriteTo, at a
// barrier. When the snapshot holds no raft index beyond what this index
// has applied, the stream is read to its end and nothing changes (false):
// this index is at least as new (raft restores its last snapshot at every
// start). Otherwise the stream is written next to the index file, fsynced
// and checked by loading it (a bad stream leaves the index untouched),
// then it replaces the index file and is reopened; lookups see the old
// state until then. A failure after the old file was closed fails the
// index (ErrFailed). The committer does nothing else meanwhile.
func (ix *Index) Restore(ctx context.Context, src io.Reader) (bool, error) {
	r := &request{kind: reqRestore, src: src, n: 1}
	if err := ix.submit(ctx, r); err != nil {
		return false, err
	}
	return r.restored, r.err
}

// restore is Restore on the committer, at a barrier.
func (ix *Index) restore(r *request) {
	br := bufio.NewReaderSize(r.src, 1<<20)
	var h [24]byte
	if _, err := io.ReadFull(br, h[:]); err != nil {
		r.err = fmt.Errorf("restore: read snapshot header: %w: %w", ErrInvalid, err)
		return
	}
	if !bytes.Equal(h[:8], snapshotMagic[:]) {
		r.err = fmt.Errorf("restore: stream starts with %q, not the index snapshot magic %q: %w", h[:8], snapshotMagic[:], ErrInvalid)
		return
	}
	applied, size := binary.BigEndian.Uint64(h[8:16]), binary.BigEndian.Uint64(h[16:24])
	if applied <= ix.applied {
		n, err := io.Copy(io.Discard, br)
		if err != nil {
			r.err = fmt.Errorf("restore: drain snapshot: %w", err)
		}
		ix.log.Info("snapshot not installed: the index is as new", zap.Uint64("snapshot_raft_index", applied),
			zap.Uint64("applied", ix.applied), zap.Int64("bytes", n))
		return
	}
	tmp := ix.cfg.Path + ".restore"
	if err := writeFileFrom(tmp, br, size); err != nil {
		r.err = fmt.Errorf("restore: %w", err)
		_ = os.Remove(tmp)
		return
	}
	ld, err := loadFile(tmp, ix.cfg)
	if err != nil {
		_ = os.Remove(tmp)
		r.err = fmt.Errorf("restore: snapshot at raft index %d does not load: %w", applied, err)
		return
	}
	if ld.applied != applied {
		_ = os.Remove(tmp)
		r.err = fmt.Errorf("restore: snapshot header says raft index %d, its file holds %d: %w", applied, ld.applied, ErrCorrupt)
		return
	}
	fail := func(err error) {
		ix.setFailed(err)
		r.err = fmt.Errorf("%w: %w", ErrFailed, err)
		ix.log.Error("snapshot install failed after closing the index; it refuses writes until reopened", zap.Error(err))
	}
	if err := ix.db.Close(); err != nil {
		fail(fmt.Errorf("restore: close %s: %w: %w", ix.cfg.Path, ErrStore, err))
		return
	}
	if err := os.Rename(tmp, ix.cfg.Path); err != nil {
		fail(fmt.Errorf("restore: rename %s: %w: %w", tmp, ErrStore, err))
		return
	}
	if err := syncDir(filepath.Dir(ix.cfg.Path)); err != nil {
		fail(fmt.Errorf("restore: %w", err))
		return
	}
	db, err := openBolt(ix.cfg)
	if err != nil {
		fail(fmt.Errorf("restore: reopen: %w", err))
		return
	}
	ix.db = db
	ld.st.bg = ix.goroutines
	ld.st.fan = ix.cfg.PublishFan
	ix.mu.Lock()
	ix.st = ld.st
	ix.mu.Unlock()
	ix.view.Store(ix.st.buildView(nil))
	ix.logBytes, ix.nextLog, ix.applied = ld.logBytes, ld.nextLog, ld.applied
	ix.folding = nil // of the file replaced; the loaded log's chunks are dirty
	ix.appliedPub.Store(ld.applied)
	ix.txns = [2]*txn{}
	ix.gauges()
	r.restored = true
	ix.log.Info("snapshot installed", zap.Uint64("raft_index", applied), zap.Uint64("bytes", size),
		zap.Int64("chunks", ld.st.chunks), zap.Int("ranks", len(ld.st.ranks)-1))
}

func writeFileFrom(path string, src io.Reader, size uint64) error {
	_ = os.Remove(path)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w: %w", path, ErrStore, err)
	}
	n, err := io.CopyN(f, src, int64(size))
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %d of %d B: %w: %w", path, n, size, ErrInvalid, err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return fmt.Errorf("fsync %s: %w: %w", path, ErrStore, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w: %w", path, ErrStore, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open dir %s: %w: %w", dir, ErrStore, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w: %w", dir, ErrStore, err)
	}
	return nil
}

// loadFile derives the state from a bbolt file other than the open one.
func loadFile(path string, cfg Config) (loaded, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: cfg.OpenTimeout, ReadOnly: true})
	if err != nil {
		return loaded{}, fmt.Errorf("open %s: %w: %w", path, ErrCorrupt, err)
	}
	defer db.Close()
	var ld loaded
	err = db.View(func(tx *bolt.Tx) error {
		var err error
		ld, err = load(tx)
		return err
	})
	return ld, err
}

// Dump is a canonical encoding of the whole state, equal byte for byte
// between two indexes that hold the same ranks (in id order, with
// incarnation, sequence and fence), namespace specs and placements,
// however their bbolt files are laid out.
type Dump struct {
	RaftIndex uint64 // the highest raft index applied
	Bytes     []byte
}

// Dump takes the state at a barrier and encodes it off the committer.
func (ix *Index) Dump(ctx context.Context) (Dump, error) {
	r := &request{kind: reqDump, n: 1}
	if err := ix.submit(ctx, r); err != nil {
		return Dump{}, err
	}
	return r.dump, r.err
}

// startDump copies the state at a barrier and encodes it on a goroutine
// of ix.goroutines, which answers r.
func (ix *Index) startDump(r *request) {
	live, applied := ix.st.snapshot(), ix.applied
	encode := func() {
		r.dump = Dump{RaftIndex: applied, Bytes: encodeDump(live)}
		close(r.done)
	}
	if !ix.goroutines.Go("dump", encode) {
		encode() // closing: on the committer
	}
}

func encodeDump(st *state) []byte {
	var b []byte
	b = binary.AppendUvarint(b, uint64(len(st.ranks)-1))
	for _, rs := range st.ranks[1:] {
		b = appendRank(b, rs.rank, rs.rankMeta)
	}
	nss := make([]dcp.Namespace, 0, len(st.ns))
	for ns, n := range st.ns {
		if n.spec != nil || n.chunks.len() > 0 {
			nss = append(nss, ns)
		}
	}
	slices.SortFunc(nss, func(a, c dcp.Namespace) int { return bytes.Compare(a[:], c[:]) })
	for _, ns := range nss {
		n := st.ns[ns]
		b = append(b, ns[:]...)
		b = binary.AppendUvarint(b, uint64(len(n.specJSON)))
		b = append(b, n.specJSON...)
		hs := make([]dcp.ChunkHash, 0, n.chunks.len())
		for h := range n.chunks.all() {
			hs = append(hs, h)
		}
		slices.SortFunc(hs, func(a, c dcp.ChunkHash) int { return bytes.Compare(a[:], c[:]) })
		b = binary.AppendUvarint(b, uint64(len(hs)))
		for _, h := range hs {
			b = append(b, h[:]...)
			v, _ := n.chunks.get(h)
			b = appendChunk(b, v.s)
		}
	}
	return b
}

// errNoApplied: the meta bucket has no raft index (never replicated).
var errNoApplied = errors.New("no raft index recorded")

// readApplied reads the recorded raft index from tx.
func readApplied(tx *bolt.Tx) (uint64, error) {
	v := tx.Bucket(bucketMeta).Get(keyApplied)
	if v == nil {
		return 0, errNoApplied
	}
	if len(v) != 8 {
		return 0, fmt.Errorf("raft index record is %d bytes, want 8: %w", len(v), ErrCorrupt)
	}
	return binary.BigEndian.Uint64(v), nil
}
