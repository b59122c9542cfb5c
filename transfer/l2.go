package transfer

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// L2Object describes one object held by an L2 tier: what its header says.
type L2Object struct {
	Key         dcp.Key
	Fingerprint [32]byte // dcp.Resolved.Fingerprint of the namespace
	Writer      wire.Rank
	Incarnation uint64 // the writer's incarnation when it wrote the object
	Size        uint64 // payload bytes
	Sum         uint64 // kvsum64 of the payload
	Created     time.Time
}

// ScanEntry is one object found by L2Tier.Scan. Err != nil means the object
// failed verification and has been quarantined: Key is valid when KeyKnown,
// Writer when WriterKnown.
type ScanEntry struct {
	Object      L2Object
	Err         error
	KeyKnown    bool
	WriterKnown bool
}

// L2Tier is the durable tier behind L1. The file tier (FileTier) is the one
// shipped; an S3-compatible one can follow. Implementations must be safe for
// concurrent use.
type L2Tier interface {
	// Put stores payload under obj.Key and returns only once it is
	// durable. An existing object of the same key is replaced atomically.
	Put(ctx context.Context, obj L2Object, payload []byte) error
	// Get reads the object of key, written by any rank, into dst and
	// returns its header. Before returning it verifies the header, that
	// the object is key's and of fingerprint fp, that its length is
	// len(dst) and that the payload's kvsum64 is the recorded one. A
	// missing object gives ErrNotFound; one that fails verification is
	// quarantined and gives a *CorruptError (errors.Is ErrCorrupt). dst
	// holds garbage after an error.
	Get(ctx context.Context, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error)
	// Stat returns the header of the object of key, written by any rank,
	// after checking that it is readable, names key and fits the object's
	// length; it does not read or verify the payload and quarantines
	// nothing. A missing object gives ErrNotFound; a bad header gives an
	// error wrapping ErrCorrupt.
	Stat(ctx context.Context, key dcp.Key) (L2Object, error)
	// Delete removes the object of key; a missing object is not an error.
	Delete(ctx context.Context, key dcp.Key) error
	// Quarantine moves the object of key aside so it is never served
	// again, recording why; a missing object gives ErrNotFound.
	Quarantine(ctx context.Context, key dcp.Key, why string) error
	// Scan calls fn for every object written by owner (verifying payload
	// checksums when verify) and for every object that fails its checks
	// (after quarantining it), including unreadable ones whose writer is
	// unknown. Leftovers of owner's interrupted writes are removed.
	Scan(ctx context.Context, owner wire.Rank, verify bool, fn func(ScanEntry)) error
}

// CorruptError reports an L2 object that failed verification.
type CorruptError struct {
	Key         dcp.Key
	Writer      wire.Rank // valid when WriterKnown
	WriterKnown bool
	Path        string // where the object was
	Quarantine  string // where it was moved; "" if the move failed
	Reason      string // what failed, with the numbers
}

func (e *CorruptError) Error() string {
	s := "L2 object " + e.Key.String() + " at " + e.Path + ": " + e.Reason
	if e.Quarantine != "" {
		s += " (quarantined to " + e.Quarantine + ")"
	} else {
		s += " (quarantine failed)"
	}
	return s
}

// Is makes errors.Is(err, ErrCorrupt) true.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

// Object file format (version 1), all integers big-endian:
//
//	[0:4]      magic "KVTO"
//	[4:6]      version, 1
//	[6:8]      header length H (bytes, including the header checksum)
//	[8:45]     key (dcp binary key)
//	[45:77]    layout fingerprint
//	[77:85]    payload length
//	[85:93]    payload kvsum64
//	[93:101]   writer incarnation
//	[101:109]  created, Unix nanoseconds
//	[109:113]  writer TP rank
//	[113]      writer instance length n (<= 64)
//	[114:114+n] writer instance
//	[H-8:H]    kvsum64 of header bytes [0, H-8)
//	[H:]       payload, exactly payload length bytes
//
// A file is written to a temporary name in its directory, fsynced, renamed
// into place and the directory fsynced, so a crash leaves either the old
// state or the whole new file; torn files can only come from the storage
// itself, and the checksums catch them.
const (
	fileMagic     = "KVTO"
	fileVersion   = 1
	fileFixedHdr  = 114
	fileMaxHdr    = fileFixedHdr + 64 + 8
	fileExt       = ".kvo"
	tmpPrefix     = ".tmp."
	quarantineDir = "quarantine"
)

func encodeHeader(o L2Object) []byte {
	b := make([]byte, 0, fileFixedHdr+len(o.Writer.Instance)+8)
	b = append(b, fileMagic...)
	b = binary.BigEndian.AppendUint16(b, fileVersion)
	b = binary.BigEndian.AppendUint16(b, uint16(fileFixedHdr+len(o.Writer.Instance)+8))
	b, _ = o.Key.AppendBinary(b)
	b = append(b, o.Fingerprint[:]...)
	b = binary.BigEndian.AppendUint64(b, o.Size)
	b = binary.BigEndian.AppendUint64(b, o.Sum)
	b = binary.BigEndian.AppendUint64(b, o.Incarnation)
	b = binary.BigEndian.AppendUint64(b, uint64(o.Created.UnixNano()))
	b = binary.BigEndian.AppendUint32(b, uint32(o.Writer.TPRank))
	b = append(b, byte(len(o.Writer.Instance)))
	b = append(b, o.Writer.Instance...)
	return binary.BigEndian.AppendUint64(b, checksum.Sum(b))
}

// readHeader reads and verifies the header of an open object file of
// fileSize bytes.
func readHeader(f io.ReaderAt, fileSize int64) (L2Object, int, error) {
	var o L2Object
	var pre [8]byte
	if _, err := f.ReadAt(pre[:], 0); err != nil {
		return o, 0, fmt.Errorf("file of %d B too short for a header: %w", fileSize, err)
	}
	if string(pre[:4]) != fileMagic {
		return o, 0, fmt.Errorf("bad magic %q, want %q", pre[:4], fileMagic)
	}
	if v := binary.BigEndian.Uint16(pre[4:]); v != fileVersion {
		return o, 0, fmt.Errorf("format version %d, want %d", v, fileVersion)
	}
	h := int(binary.BigEndian.Uint16(pre[6:]))
	if h < fileFixedHdr+8 || h > fileMaxHdr {
		return o, 0, fmt.Errorf("header length %d outside %d..%d", h, fileFixedHdr+8, fileMaxHdr)
	}
	b := make([]byte, h)
	if _, err := f.ReadAt(b, 0); err != nil {
		return o, 0, fmt.Errorf("header of %d B truncated in a %d B file: %w", h, fileSize, err)
	}
	if got, want := checksum.Sum(b[:h-8]), binary.BigEndian.Uint64(b[h-8:]); got != want {
		return o, 0, fmt.Errorf("header checksum %016x, recorded %016x", got, want)
	}
	n := int(b[113])
	if fileFixedHdr+n+8 != h {
		return o, 0, fmt.Errorf("writer instance of %d B does not fit header length %d", n, h)
	}
	if err := o.Key.UnmarshalBinary(b[8:45]); err != nil {
		return o, 0, err
	}
	copy(o.Fingerprint[:], b[45:77])
	o.Size = binary.BigEndian.Uint64(b[77:])
	o.Sum = binary.BigEndian.Uint64(b[85:])
	o.Incarnation = binary.BigEndian.Uint64(b[93:])
	o.Created = time.Unix(0, int64(binary.BigEndian.Uint64(b[101:])))
	o.Writer.TPRank = int(binary.BigEndian.Uint32(b[109:]))
	o.Writer.Instance = string(b[114 : 114+n])
	if want := int64(h) + int64(o.Size); o.Size > 1<<50 || fileSize != want {
		return o, h, fmt.Errorf("file is %d B, header %d B + payload %d B = %d B", fileSize, h, o.Size, want)
	}
	return o, h, nil
}

// FileTier is the L2 tier on a (local or shared) file system:
// <root>/<namespace hex>/<key>.kvo, plus <root>/quarantine/ for files that
// failed verification.
type FileTier struct {
	root string

	// mu guards dirs, the namespace directories known to exist and be
	// durable.
	mu   sync.Mutex
	dirs map[dcp.Namespace]bool
}

// OpenFileTier opens (creating) the file tier rooted at root.
func OpenFileTier(root string) (*FileTier, error) {
	if root == "" {
		return nil, fmt.Errorf("L2 root is empty: %w", ErrConfig)
	}
	if err := os.MkdirAll(filepath.Join(root, quarantineDir), 0o755); err != nil {
		return nil, fmt.Errorf("create L2 root %s: %w", root, errors.Join(err, ErrIO))
	}
	return &FileTier{root: root, dirs: make(map[dcp.Namespace]bool)}, nil
}

// Root returns the tier's root directory.
func (t *FileTier) Root() string { return t.root }

// Path returns the file of key.
func (t *FileTier) Path(key dcp.Key) string {
	return filepath.Join(t.root, key.NS.String(), key.String()+fileExt)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

func (t *FileTier) nsDir(ns dcp.Namespace) (string, error) {
	dir := filepath.Join(t.root, ns.String())
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dirs[ns] {
		return dir, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := syncDir(t.root); err != nil {
		return "", err
	}
	t.dirs[ns] = true
	return dir, nil
}

func tmpName(key dcp.Key, w wire.Rank) string {
	var r [6]byte
	_, _ = rand.Read(r[:])
	return tmpPrefix + key.String() + "." + w.Instance + "-" + strconv.Itoa(w.TPRank) + "." + hex.EncodeToString(r[:])
}

// Put implements L2Tier: temp file, write, fsync, rename, fsync directory.
func (t *FileTier) Put(ctx context.Context, obj L2Object, payload []byte) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	if uint64(len(payload)) != obj.Size {
		return fmt.Errorf("put %s: payload %d B, header says %d B: %w", obj.Key, len(payload), obj.Size, ErrIO)
	}
	if wire.ValidInstance(obj.Writer.Instance) != nil {
		return fmt.Errorf("put %s: writer instance %q invalid: %w", obj.Key, obj.Writer.Instance, ErrIO)
	}
	ioErr := func(step string, e error) error {
		return fmt.Errorf("put %s: %s: %w", obj.Key, step, errors.Join(e, ErrIO))
	}
	dir, err := t.nsDir(obj.Key.NS)
	if err != nil {
		return ioErr("create namespace directory", err)
	}
	tmp := filepath.Join(dir, tmpName(obj.Key, obj.Writer))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return ioErr("create temp file", err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if _, err = f.Write(encodeHeader(obj)); err != nil {
		return ioErr("write header", err)
	}
	if _, err = f.Write(payload); err != nil {
		return ioErr("write payload", err)
	}
	if err = f.Sync(); err != nil {
		return ioErr("fsync", err)
	}
	if err = f.Close(); err != nil {
		return ioErr("close", err)
	}
	if err = os.Rename(tmp, t.Path(obj.Key)); err != nil {
		return ioErr("rename", err)
	}
	if err = syncDir(dir); err != nil {
		return ioErr("fsync directory", err)
	}
	return nil
}

// Get implements L2Tier.
func (t *FileTier) Get(ctx context.Context, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	if err := ctx.Err(); err != nil {
		return L2Object{}, err
	}
	path := t.Path(key)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return L2Object{}, fmt.Errorf("L2 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return L2Object{}, fmt.Errorf("open L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return L2Object{}, fmt.Errorf("stat L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	o, h, err := readHeader(f, st.Size())
	if err != nil {
		return o, t.corrupt(key, o, h > 0, path, err.Error())
	}
	switch {
	case o.Key != key:
		return o, t.corrupt(key, o, true, path, "header names key "+o.Key.String())
	case o.Fingerprint != fp:
		return o, t.corrupt(key, o, true, path, fmt.Sprintf("layout fingerprint %x, namespace has %x", o.Fingerprint[:8], fp[:8]))
	case o.Size != uint64(len(dst)):
		return o, t.corrupt(key, o, true, path, fmt.Sprintf("payload %d B, the geometry says %d B", o.Size, len(dst)))
	}
	if _, err := f.ReadAt(dst, int64(h)); err != nil {
		return o, fmt.Errorf("read L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	if sum := checksum.Sum(dst); sum != o.Sum {
		return o, t.corrupt(key, o, true, path, fmt.Sprintf("payload kvsum64 %016x, recorded %016x", sum, o.Sum))
	}
	return o, nil
}

// Stat implements L2Tier.
func (t *FileTier) Stat(ctx context.Context, key dcp.Key) (L2Object, error) {
	if err := ctx.Err(); err != nil {
		return L2Object{}, err
	}
	f, err := os.Open(t.Path(key))
	if errors.Is(err, fs.ErrNotExist) {
		return L2Object{}, fmt.Errorf("L2 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return L2Object{}, fmt.Errorf("open L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return L2Object{}, fmt.Errorf("stat L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	o, _, err := readHeader(f, st.Size())
	if err == nil && o.Key != key {
		err = fmt.Errorf("header names key %s", o.Key)
	}
	if err != nil {
		return o, fmt.Errorf("L2 object %s: %s: %w", key, err, ErrCorrupt)
	}
	return o, nil
}

// corrupt quarantines path and returns the *CorruptError describing it.
func (t *FileTier) corrupt(key dcp.Key, o L2Object, writerKnown bool, path, why string) error {
	ce := &CorruptError{Key: key, Writer: o.Writer, WriterKnown: writerKnown, Path: path, Reason: why}
	if q, err := t.moveAside(path, why); err == nil {
		ce.Quarantine = q
	}
	return ce
}

func (t *FileTier) moveAside(path, why string) (string, error) {
	qdir := filepath.Join(t.root, quarantineDir)
	var r [4]byte
	_, _ = rand.Read(r[:])
	q := filepath.Join(qdir, filepath.Base(path)+"."+strconv.FormatInt(time.Now().UnixNano(), 10)+"."+hex.EncodeToString(r[:]))
	if err := os.Rename(path, q); err != nil {
		return "", err
	}
	// The reason travels beside the file for the operator; best effort.
	_ = os.WriteFile(q+".why", []byte(why+"\n"), 0o644)
	_ = syncDir(qdir)
	_ = syncDir(filepath.Dir(path))
	return q, nil
}

// Delete implements L2Tier.
func (t *FileTier) Delete(ctx context.Context, key dcp.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	path := t.Path(key)
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	if err := syncDir(filepath.Dir(path)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete L2 object %s: fsync directory: %w", key, errors.Join(err, ErrIO))
	}
	return nil
}

// Quarantine implements L2Tier.
func (t *FileTier) Quarantine(ctx context.Context, key dcp.Key, why string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, err := t.moveAside(t.Path(key), why); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("quarantine L2 object %s: %w", key, ErrNotFound)
		}
		return fmt.Errorf("quarantine L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	return nil
}

// Scan implements L2Tier. Files of other writers with readable headers are
// skipped (their writers verify them; every Get verifies anyway).
func (t *FileTier) Scan(ctx context.Context, owner wire.Rank, verify bool, fn func(ScanEntry)) error {
	nsDirs, err := os.ReadDir(t.root)
	if err != nil {
		return fmt.Errorf("scan L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	myTmp := "." + owner.Instance + "-" + strconv.Itoa(owner.TPRank) + "."
	buf := make([]byte, 1<<20)
	for _, d := range nsDirs {
		ns, err := dcp.ParseNamespace(d.Name())
		if !d.IsDir() || err != nil {
			continue
		}
		dir := filepath.Join(t.root, d.Name())
		files, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("scan L2 directory %s: %w", dir, errors.Join(err, ErrIO))
		}
		t.mu.Lock()
		t.dirs[ns] = true
		t.mu.Unlock()
		for _, fe := range files {
			if err := ctx.Err(); err != nil {
				return err
			}
			name := fe.Name()
			path := filepath.Join(dir, name)
			if strings.HasPrefix(name, tmpPrefix) {
				if strings.Contains(name, myTmp) {
					_ = os.Remove(path) // an interrupted write of ours
				}
				continue
			}
			if !strings.HasSuffix(name, fileExt) || fe.IsDir() {
				continue
			}
			key, kerr := dcp.ParseKey(strings.TrimSuffix(name, fileExt))
			if kerr != nil || key.NS != ns {
				continue // not an object file of ours to judge
			}
			e := t.scanFile(path, key, owner, verify, buf)
			if e != nil {
				fn(*e)
			}
		}
	}
	return nil
}

// scanFile checks one file; nil means it is another writer's and was
// skipped.
func (t *FileTier) scanFile(path string, key dcp.Key, owner wire.Rank, verify bool, buf []byte) *ScanEntry {
	bad := func(o L2Object, writerKnown bool, why string) *ScanEntry {
		o.Key = key
		return &ScanEntry{Object: o, KeyKnown: true, WriterKnown: writerKnown,
			Err: t.corrupt(key, o, writerKnown, path, why)}
	}
	f, err := os.Open(path)
	if err != nil {
		return nil // vanished (deleted or quarantined by another rank)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	o, h, err := readHeader(f, st.Size())
	if err != nil && h == 0 {
		// Unreadable header: the writer is unknown. Only the shard's writer
		// quarantines it (writer TP rank = shard, see dcp.StoreShard), so
		// ranks sharing the root do not race over it.
		if int(key.Shard) != owner.TPRank {
			return nil
		}
		return bad(o, false, err.Error())
	}
	if o.Writer != owner {
		return nil
	}
	if err != nil {
		return bad(o, true, err.Error())
	}
	if o.Key != key {
		return bad(o, true, "header names key "+o.Key.String())
	}
	if verify {
		var d checksum.Digest
		if _, err := io.CopyBuffer(&d, io.NewSectionReader(f, int64(h), int64(o.Size)), buf); err != nil {
			return bad(o, true, "read payload: "+err.Error())
		}
		if d.Len() != o.Size {
			return bad(o, true, fmt.Sprintf("payload %d B, recorded %d B", d.Len(), o.Size))
		}
		if sum := d.Sum64(); sum != o.Sum {
			return bad(o, true, fmt.Sprintf("payload kvsum64 %016x, recorded %016x", sum, o.Sum))
		}
	}
	return &ScanEntry{Object: o, KeyKnown: true, WriterKnown: true}
}
