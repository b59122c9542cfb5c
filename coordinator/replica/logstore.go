package replica

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
)

// LogStore is raft's log store and stable store in one bbolt file
// (raft.db in the raft dir), fsynced on every commit: raft's safety rests
// on a vote or an appended entry being durable before it is answered.
//
// Why not raft-boltdb: its v2.3.1 imports go-metrics/compat, which
// go-metrics v0.7.0 (required by raft v1.8.0 and memberlist v0.7.0)
// no longer has, so the two do not build together. The store is the small
// part; the consensus protocol is hashicorp/raft's.
//
// Layout: bucket "logs": index (8 B big-endian) -> term (8), type (1),
// appended-at Unix ns (8), data length (uvarint), data, extensions length
// (uvarint), extensions. Bucket "stable": key -> value.
type LogStore struct {
	db *bolt.DB
}

var (
	bucketRaftLogs   = []byte("logs")
	bucketRaftStable = []byte("stable")
)

// errKeyNotFound is what raft expects from a stable store for a key it
// never set: it compares the message, "not found".
var errKeyNotFound = errors.New("not found")

func OpenLogStore(path string) (*LogStore, error) {
	_, statErr := os.Stat(path)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second, NoFreelistSync: true,
		FreelistType: bolt.FreelistMapType})
	if err != nil {
		return nil, fmt.Errorf("open raft store %s: %w", path, err)
	}
	// bbolt fsyncs a file it creates, never its directory: until the
	// directory is fsynced, a power cut can lose raft.db's name and with it
	// every vote and entry stored since.
	if errors.Is(statErr, fs.ErrNotExist) {
		if err := syncDir(filepath.Dir(path)); err != nil {
			_ = db.Close()
			return nil, fmt.Errorf("open raft store %s: %w", path, err)
		}
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketRaftLogs, bucketRaftStable} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("init raft store %s: %w", path, err)
	}
	return &LogStore{db: db}, nil
}

func (s *LogStore) Close() error { return s.db.Close() }

func (s *LogStore) edge(first bool) (uint64, error) {
	var idx uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketRaftLogs).Cursor()
		var k []byte
		if first {
			k, _ = c.First()
		} else {
			k, _ = c.Last()
		}
		if len(k) == 8 {
			idx = binary.BigEndian.Uint64(k)
		}
		return nil
	})
	return idx, err
}

// FirstIndex, LastIndex, GetLog, StoreLog(s), DeleteRange: raft.LogStore.
func (s *LogStore) FirstIndex() (uint64, error) { return s.edge(true) }
func (s *LogStore) LastIndex() (uint64, error)  { return s.edge(false) }

func (s *LogStore) GetLog(index uint64, l *raft.Log) error {
	return s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketRaftLogs).Get(binary.BigEndian.AppendUint64(nil, index))
		if v == nil {
			return raft.ErrLogNotFound
		}
		return decodeRaftLog(index, v, l)
	})
}

func (s *LogStore) StoreLog(l *raft.Log) error { return s.StoreLogs([]*raft.Log{l}) }

func (s *LogStore) StoreLogs(logs []*raft.Log) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketRaftLogs)
		for _, l := range logs {
			if err := b.Put(binary.BigEndian.AppendUint64(nil, l.Index), encodeRaftLog(l)); err != nil {
				return fmt.Errorf("store raft log %d: %w", l.Index, err)
			}
		}
		return nil
	})
}

func (s *LogStore) DeleteRange(min, max uint64) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketRaftLogs).Cursor()
		for k, _ := c.Seek(binary.BigEndian.AppendUint64(nil, min)); k != nil; k, _ = c.Next() {
			if binary.BigEndian.Uint64(k) > max {
				break
			}
			if err := c.Delete(); err != nil {
				return fmt.Errorf("delete raft logs %d..%d: %w", min, max, err)
			}
		}
		return nil
	})
}

// Set, Get, SetUint64, GetUint64: raft.StableStore.
func (s *LogStore) Set(k, v []byte) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRaftStable).Put(k, append([]byte(nil), v...))
	})
}

func (s *LogStore) Get(k []byte) ([]byte, error) {
	var out []byte
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketRaftStable).Get(k)
		if v == nil {
			return errKeyNotFound
		}
		out = append([]byte(nil), v...)
		return nil
	})
	return out, err
}

func (s *LogStore) SetUint64(k []byte, v uint64) error {
	return s.Set(k, binary.BigEndian.AppendUint64(nil, v))
}

func (s *LogStore) GetUint64(k []byte) (uint64, error) {
	v, err := s.Get(k)
	if err != nil {
		return 0, err
	}
	if len(v) != 8 {
		return 0, fmt.Errorf("raft stable key %q holds %d bytes, want 8", k, len(v))
	}
	return binary.BigEndian.Uint64(v), nil
}

func encodeRaftLog(l *raft.Log) []byte {
	b := make([]byte, 0, 8+1+8+2*binary.MaxVarintLen64+len(l.Data)+len(l.Extensions))
	b = binary.BigEndian.AppendUint64(b, l.Term)
	b = append(b, byte(l.Type))
	var at int64
	if !l.AppendedAt.IsZero() {
		at = l.AppendedAt.UnixNano()
	}
	b = binary.BigEndian.AppendUint64(b, uint64(at))
	b = binary.AppendUvarint(b, uint64(len(l.Data)))
	b = append(b, l.Data...)
	b = binary.AppendUvarint(b, uint64(len(l.Extensions)))
	return append(b, l.Extensions...)
}

func decodeRaftLog(index uint64, v []byte, l *raft.Log) error {
	bad := func(what string) error {
		return fmt.Errorf("raft log %d: %s (%d B record): %w", index, what, len(v), ErrCorrupt)
	}
	if len(v) < 17 {
		return bad("short header")
	}
	*l = raft.Log{Index: index, Term: binary.BigEndian.Uint64(v), Type: raft.LogType(v[8])}
	if at := int64(binary.BigEndian.Uint64(v[9:17])); at != 0 {
		l.AppendedAt = time.Unix(0, at)
	}
	p := v[17:]
	n, k := binary.Uvarint(p)
	if k <= 0 || uint64(len(p)-k) < n {
		return bad("data length")
	}
	l.Data = append([]byte(nil), p[k:k+int(n)]...)
	p = p[k+int(n):]
	n, k = binary.Uvarint(p)
	if k <= 0 || uint64(len(p)-k) != n {
		return bad("extensions length")
	}
	if n > 0 {
		l.Extensions = append([]byte(nil), p[k:]...)
	}
	return nil
}

// PrivateDir creates dir (0700) if missing, durably (the parent of each
// directory created is fsynced), and checks it is a directory of this
// user, not a symlink, with no group or other access: the raft log and
// snapshots are the index.
func PrivateDir(dir string) error {
	dir = filepath.Clean(dir)
	var made []string // missing before, innermost first
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) || filepath.Dir(d) == d {
			break
		}
		made = append(made, d)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create raft dir %s: %w: %w", dir, ErrConfig, err)
	}
	for _, d := range made { // a new directory's name is durable once its parent is fsynced
		if err := syncDir(filepath.Dir(d)); err != nil {
			return fmt.Errorf("create raft dir %s: %w", dir, err)
		}
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("raft dir %s: %w: %w", dir, ErrConfig, err)
	}
	if st.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("raft dir %s is a symlink; symlinks are refused: %w", dir, ErrConfig)
	}
	if !st.IsDir() {
		return fmt.Errorf("raft dir %s is not a directory: %w", dir, ErrConfig)
	}
	if m := st.Mode().Perm(); m&0o077 != 0 {
		return fmt.Errorf("raft dir %s has mode %04o; want no group or other access (chmod 700): %w", dir, m, ErrConfig)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("raft dir %s is owned by uid %d, not %d: %w", dir, sys.Uid, os.Geteuid(), ErrConfig)
	}
	return nil
}

// syncDir fsyncs directory dir: the names created or renamed in it are
// durable once it returns.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}
