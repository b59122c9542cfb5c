package index_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/index/indextest"
	"github.com/kvtier/kvtier/wire"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/zap/zaptest"
)

// TestDamagedBucketIsCaught (issue 11.11): one bit flipped in a value of
// the chunks, log or ranks bucket — bytes that still decode — makes Open
// fail with ErrCorrupt naming the record. Before per-record checksums, a
// flipped bit in a recorded sum loaded silently and Verify passed (it
// compared two decodings of the same damaged bytes).
func TestDamagedBucketIsCaught(t *testing.T) {
	for _, bucket := range []string{"chunks", "log", "ranks"} {
		t.Run(bucket, func(t *testing.T) {
			ix := openTest(t, "", func(c *index.Config) { c.CheckpointBytes = 1 << 40 })
			s := indextest.NewRank(wire.Rank{Instance: "eng", TPRank: 0}, 1, indextest.Keys(testNS, 2, 16, 1, 1), 3)
			if _, err := ix.Apply(ctx, s.Next(8)); err != nil {
				t.Fatal(err)
			}
			if bucket != "log" {
				if err := ix.Checkpoint(ctx); err != nil { // folds the log into chunks
					t.Fatal(err)
				}
			}
			// The committed file as a crash would leave it (the index is
			// idle, every commit fsynced): the log record stays.
			path := filepath.Join(t.TempDir(), "index.db")
			data, err := os.ReadFile(ix.path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			flipLastValueBit(t, path, bucket)
			cfg := index.DefaultConfig()
			cfg.Path = path
			cfg.Logger = zaptest.NewLogger(t)
			ix3, err := index.Open(cfg)
			if err == nil {
				rep, verr := ix3.Verify(ctx)
				_ = ix3.Close()
				t.Fatalf("open after a bit flip in %s succeeded; verify: %v %v", bucket, rep.Problems, verr)
			}
			if !errors.Is(err, index.ErrCorrupt) || !strings.Contains(err.Error(), "checksum") {
				t.Fatalf("open after a bit flip in %s: %v, want ErrCorrupt naming the checksum", bucket, err)
			}
			t.Logf("caught: %v", err)
		})
	}
}

// flipLastValueBit flips the lowest bit of the byte 6 from the end of the
// first value of bucket: inside a chunk's last recorded sum, a log
// record's last put's sum, or a rank's fenced flag — bytes that still
// decode.
func flipLastValueBit(t *testing.T, path, bucket string) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte(bucket))
		if b == nil {
			return errors.New("no bucket " + bucket)
		}
		k, v := b.Cursor().First()
		if k == nil {
			return errors.New("bucket " + bucket + " is empty")
		}
		if v == nil { // a change-log record in its own bucket
			if b = b.Bucket(k); b == nil {
				return errors.New("first key of bucket " + bucket + " is neither a value nor a bucket")
			}
			if k, v = b.Cursor().First(); k == nil {
				return errors.New("the first record bucket of " + bucket + " is empty")
			}
		}
		if len(v) < 8 {
			return errors.New("value too short")
		}
		nv := append([]byte(nil), v...)
		// Chunks and log records end with a sum (8 B), then the 4 B
		// checksum trailer in version 2 records: -6 is inside the sum
		// either way. Rank records end with the fenced flag.
		i := len(nv) - 6
		if bucket == "ranks" {
			i = len(nv) - 1
			if nv[0] == 2 {
				i = len(nv) - 5
			}
		}
		nv[i] ^= 1
		return b.Put(append([]byte(nil), k...), nv)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestResetRank: a reset drops the rank's placements and forgets its
// incarnation, so the real incarnation is accepted again; the state on
// disk agrees (Verify, and after a reopen).
func TestResetRank(t *testing.T) {
	dir := t.TempDir()
	ix := openTest(t, dir, nil)
	r := wire.Rank{Instance: "eng", TPRank: 0}
	real := indextest.NewRank(r, 5, indextest.Keys(testNS, 2, 16, 1, 1), 3)
	if _, err := ix.Apply(ctx, real.Next(6)); err != nil {
		t.Fatal(err)
	}
	bad := indextest.NewRank(r, 1<<64-1, indextest.Keys(testNS, 2, 16, 1, 1), 4)
	if o, err := ix.Apply(ctx, bad.Next(1)); err != nil || !o.NewIncarnation {
		t.Fatalf("bad incarnation: %+v %v", o, err)
	}
	if o, _ := ix.Apply(ctx, real.Next(1)); o.Reason != index.DropStaleIncarnation {
		t.Fatalf("real incarnation before the reset: %+v", o)
	}
	n, err := ix.ResetRank(ctx, r)
	if err != nil || n == 0 {
		t.Fatalf("reset: %d %v", n, err)
	}
	if ri, _ := ix.Rank(r); ri.Incarnation != 0 || ri.LastSeq != 0 || ri.Fenced || ri.L1Placements+ri.L2Placements != 0 {
		t.Fatalf("after the reset: %+v", ri)
	}
	o, err := ix.Apply(ctx, real.Next(1))
	if err != nil || !o.NewIncarnation || !o.Resync {
		t.Fatalf("real incarnation after the reset: %+v %v (want a new incarnation asking for a resync)", o, err)
	}
	if _, err := ix.Verify(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := ix.ResetRank(ctx, wire.Rank{Instance: "never", TPRank: 0}); !errors.Is(err, index.ErrUnknownRank) {
		t.Fatalf("reset of an unknown rank: %v", err)
	}
	if err := ix.Close(); err != nil {
		t.Fatal(err)
	}
	ix2 := openTest(t, dir, nil)
	if ri, _ := ix2.Rank(r); ri.Incarnation != 5 {
		t.Fatalf("after a reopen: %+v", ri)
	}
}
