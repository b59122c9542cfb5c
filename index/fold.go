package index

import (
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap"
)

// Folding the change log into the snapshot bucket (doc.go, "bbolt
// layout"): the automatic fold, cut at Config.CheckpointBytes and written
// in slices riding along with the group commits, and the whole fold of
// Checkpoint and Close.

// foldJob is an automatic fold in progress: f's chunks are written
// FoldSliceChunks per commit from pos on, each slice with the chunks'
// values when it is taken (nextSlice, on the committer: published
// placement slices are never modified, so the writer reads them while the
// committer goes on); the last slice deletes the log records below below
// (those the fold covers). A crash at any point is safe: the snapshot
// then holds some chunks as they were when their slice was taken (at or
// after the cut) and the rest older, and Open replays every log record
// from the cut on, in order, on top; its ops give every placement its
// last value whatever the snapshot held of it (put and del set one
// placement; fence and drop remove what matches, which replaying again
// removes no more, and whatever a later record put back is put back by
// that record again).
type foldJob struct {
	f     *fold
	pos   int
	below uint64
	start time.Time
	// sorted is closed once f.refs and f.prevs are set (the goroutine
	// the cut started); no slice is taken before.
	sorted chan struct{}
}

// testHookFoldSort, when set (tests), runs in an automatic fold's sorting
// goroutine before it sorts.
var testHookFoldSort func()

// ready reports whether j's chunk list is sorted.
func (j *foldJob) ready() bool {
	select {
	case <-j.sorted:
		return true
	default:
		return false
	}
}

// foldSlice is one slice of a foldJob handed to the writer.
type foldSlice struct {
	job      *foldJob
	from, to int
	chunks   [][]placement // of refs[from:to], as nextSlice found them
	below    uint64        // non-zero on the last slice: delete the log records below it
}

// nextSlice takes the next slice of the fold in progress.
func (ix *Index) nextSlice() *foldSlice {
	j := ix.folding
	s := &foldSlice{job: j, from: j.pos, to: min(j.pos+ix.cfg.FoldSliceChunks, len(j.f.refs))}
	s.chunks = ix.chunksOf(j.f.refs[s.from:s.to])
	j.pos = s.to
	if s.to == len(j.f.refs) {
		s.below = j.below
	}
	return s
}

// landSlice accounts for a fold slice written (err nil) or not; the
// fold ends with its last slice.
func (ix *Index) landSlice(s *foldSlice, err error) error {
	if err != nil {
		ix.folding, ix.st.folding = nil, 0
		return ix.landFold(s.job.f, s.job.start, err)
	}
	ix.met.foldSlices.Inc()
	if s.below == 0 {
		return nil
	}
	ix.folding, ix.st.folding = nil, 0
	ix.gauges()
	return ix.landFold(s.job.f, s.job.start, nil)
}

// writeSlice writes a fold slice; the last one deletes the change log
// records the fold covers.
func writeSlice(tx *bolt.Tx, s *foldSlice) error {
	f := s.job.f
	if err := writeChunks(tx, &fold{gen: f.gen, refs: f.refs[s.from:s.to], prevs: f.prevs[s.from:s.to], chunks: s.chunks}); err != nil {
		return err
	}
	if s.below == 0 {
		return nil
	}
	b := tx.Bucket(bucketLog)
	var keys [][]byte
	var nested []bool
	c := b.Cursor()
	for k, v := c.First(); k != nil && binary.BigEndian.Uint64(k) < s.below; k, v = c.Next() {
		keys, nested = append(keys, slices.Clone(k)), append(nested, v == nil)
	}
	for i, k := range keys {
		del := b.Delete
		if nested[i] {
			del = b.DeleteBucket
		}
		if err := del(k); err != nil {
			return fmt.Errorf("delete folded log record %d: %w: %w", binary.BigEndian.Uint64(k), ErrStore, err)
		}
	}
	return nil
}

// fold is a checkpoint's work: every chunk changed since the last one, with
// its placements at the moment the fold was cut (published slices are never
// modified, so they can be written while the committer carries on).
type fold struct {
	gen      uint32 // the epoch it folds: its records' generation
	refs     []chunkRef
	prevs    []uint32      // per chunk: the generation of its record on disk, or noRecord
	chunks   [][]placement // per chunk, nil: gone (an automatic fold's slices carry their own)
	logBytes int64
}

// part is the fold of refs[from:], its chunks as they are now.
func (ix *Index) part(f *fold, from int) *fold {
	return &fold{gen: f.gen, refs: f.refs[from:], prevs: f.prevs[from:], chunks: ix.chunksOf(f.refs[from:])}
}

// chunksOf returns the published placements of refs (nil: gone).
func (ix *Index) chunksOf(refs []chunkRef) [][]placement {
	cs := make([][]placement, len(refs))
	for i, ref := range refs {
		cs[i] = ix.st.chunk(ref)
	}
	return cs
}

// cutDirty ends the checkpoint epoch: it hands over the dirty list (the
// chunks the fold of the epoch, generation gen, writes) and the log bytes
// it covers, and starts a new epoch. Called with nothing in flight, so
// the published state is the committed one.
func (ix *Index) cutDirty() (gen uint32, dirty dirtyList, logBytes int64) {
	gen, dirty, logBytes = ix.st.epoch, ix.st.dirty, ix.logBytes
	ix.st.dirty = dirtyList{}
	ix.st.epoch++
	ix.logBytes = 0
	return gen, dirty, logBytes
}

// cutFold is a fold of everything published so far, whole: cutDirty, the
// list sorted and every chunk read, on the caller's goroutine
// (Checkpoint and Close).
func (ix *Index) cutFold() *fold {
	gen, dirty, logBytes := ix.cutDirty()
	f := &fold{gen: gen, logBytes: logBytes}
	f.refs, f.prevs = sortDirty(dirty.flat())
	f.chunks = ix.chunksOf(f.refs)
	return f
}

// writeFold writes a fold and empties the change log, in one transaction.
func writeFold(tx *bolt.Tx, f *fold) error {
	if err := writeChunks(tx, f); err != nil {
		return err
	}
	if err := tx.DeleteBucket(bucketLog); err != nil {
		return fmt.Errorf("truncate log: %w: %w", ErrStore, err)
	}
	if _, err := tx.CreateBucket(bucketLog); err != nil {
		return fmt.Errorf("truncate log: %w: %w", ErrStore, err)
	}
	return nil
}

// writeChunks writes f's chunks into the snapshot bucket under f's
// generation (nil or empty: the chunk is gone), deleting each chunk's
// older record.
func writeChunks(tx *bolt.Tx, f *fold) error {
	b := tx.Bucket(bucketSnap)
	// A fold's keys sort after every key in the bucket, in the order they
	// are put: split the pages they fill full, not in halves.
	b.FillPercent = 0.95
	// Keys and values must stay valid until the commit: one arena, never
	// overwritten (a grown arena leaves the old one intact).
	arena := make([]byte, 0, len(f.refs)*(2*snapshotKeySize+64))
	for i, ref := range f.refs {
		if prev := f.prevs[i]; prev != noRecord && prev != f.gen {
			ks := len(arena)
			arena = appendSnapshotKey(arena, prev, ref)
			if err := b.Delete(arena[ks:len(arena):len(arena)]); err != nil {
				return fmt.Errorf("delete chunk record of generation %d: %w: %w", prev, ErrStore, err)
			}
		}
		if len(f.chunks[i]) == 0 {
			continue
		}
		ks := len(arena)
		arena = appendSnapshotKey(arena, f.gen, ref)
		key := arena[ks:len(arena):len(arena)]
		vs := len(arena)
		arena = appendChunk(arena, f.chunks[i])
		if err := b.Put(key, arena[vs:len(arena):len(arena)]); err != nil {
			return fmt.Errorf("write chunk: %w: %w", ErrStore, err)
		}
	}
	return nil
}

// landFold accounts for a fold written by the writer (or by checkpoint).
func (ix *Index) landFold(f *fold, start time.Time, err error) error {
	if err != nil {
		ix.setFailed(err)
		ix.log.Error("checkpoint failed; the index refuses writes until reopened", zap.Error(err))
		return fmt.Errorf("%w: %w", ErrFailed, err)
	}
	took := time.Since(start)
	ix.met.checkpoints.Inc()
	ix.met.ckptSecs.Observe(took.Seconds())
	ix.log.Info("checkpoint", zap.Int("chunks", len(f.refs)), zap.Int64("log_bytes", f.logBytes), zap.Duration("took", took))
	return nil
}

// checkpoint folds the change log into the snapshot bucket now, on the
// committer: every chunk changed since the last checkpoint is written from
// the published state, and the log is emptied, in one transaction. The
// committer calls it with nothing in flight (the automatic checkpoint at
// CheckpointBytes goes through the writer instead, see land).
func (ix *Index) checkpoint() error {
	if ix.failed != nil {
		return fmt.Errorf("%w: %w", ErrFailed, ix.failed)
	}
	if ix.st.dirty.len() == 0 && ix.logBytes == 0 && ix.folding == nil {
		return nil
	}
	start := time.Now()
	var rest *fold // what the automatic fold in progress has not written yet
	if j := ix.folding; j != nil {
		<-j.sorted
		rest = ix.part(j.f, j.pos)
		ix.folding = nil // st.folding stays until the cut below: f's chunks created meanwhile delete rest's records
	}
	f := ix.cutFold()
	ix.st.folding = 0
	ix.nextLog = 1
	ix.met.logBytes.Set(0)
	return ix.landFold(f, start, ix.db.Update(func(tx *bolt.Tx) error {
		if rest != nil { // older values: written first, f's overwrite them
			if err := writeChunks(tx, rest); err != nil {
				return err
			}
		}
		return writeFold(tx, f)
	}))
}

// finish runs on the committer when it stops: a final checkpoint so the
// next Open has no log to replay.
func (ix *Index) finish() {
	if ix.failed != nil || (ix.st.dirty.len() == 0 && ix.logBytes == 0 && ix.folding == nil) {
		return
	}
	if err := ix.checkpoint(); err != nil {
		ix.closeErr = err
	}
}
