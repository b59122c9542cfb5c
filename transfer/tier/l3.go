package tier

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// ObjectStore is what the L3 tier needs of an S3-compatible object store
// (objstore.Store implements it). Names are relative to the store's bucket
// and prefix. Implementations must be safe for concurrent use.
type ObjectStore interface {
	// Put stores size bytes of r under name, replacing any object of that
	// name, and returns once the store acknowledged all of them.
	Put(ctx context.Context, name string, r io.Reader, size int64) error
	// Open returns n bytes of name from off (to the end when n is 0) and
	// how many body holds; a missing object gives an error wrapping
	// fs.ErrNotExist.
	Open(ctx context.Context, name string, off, n int64) (body io.ReadCloser, length int64, err error)
	// Delete removes name; a missing object is not an error.
	Delete(ctx context.Context, name string) error
	// List calls fn for every object whose name starts with prefix.
	List(ctx context.Context, prefix string, fn func(name string, size int64) error) error
}

// L3Tier keeps objects in an object store, one per key, in the L2 file
// format (header with key, fingerprint, writer, length and kvsum64, then
// the payload), under <instance>/<namespace hex>/<key>.kvo: the ranks of
// one engine instance share its objects, as they share an L2 root. Every
// read is verified like an L2 read (C5); an object that fails is reported
// as a *CorruptError with Kept set and left in the bucket: only the rank
// that wrote it removes or rewrites it (a reader's delete could remove a
// rewrite made since its read). An object whose header MAC does not
// verify with the cluster's storage key (C12) is neither served nor
// announced nor deleted (a wrong key must not empty a bucket): it is
// reported with Unverified and Kept, and a later store of its key
// overwrites it.
//
// With a key it also reads encrypted objects (format 3, l3crypt.go),
// whatever it writes; NewEncryptingL3Tier's tier also writes them.
type L3Tier struct {
	store    ObjectStore
	instance string
	key      *MACKey        // nil: no MAC written or checked (insecure)
	cipher   *payloadCipher // nil without a key: encrypted objects are unverified
	encrypt  bool           // write payloads encrypted (format 3)
}

// NewL3Tier returns the L3 tier of instance on store; key is the cluster's
// storage MAC key, as for OpenFileTier. It writes payloads in clear
// (format 2, as before encryption existed) and reads both formats.
func NewL3Tier(store ObjectStore, instance string, key *MACKey) *L3Tier {
	t := &L3Tier{store: store, instance: instance, key: key}
	if key != nil {
		t.cipher = newPayloadCipher(key)
	}
	return t
}

// NewEncryptingL3Tier is NewL3Tier whose writes encrypt the payload with
// AES-256-GCM under a key derived from key, the instance and the object's
// namespace (format 3, l3crypt.go). key is required: the payload keys are
// derived from it.
func NewEncryptingL3Tier(store ObjectStore, instance string, key *MACKey) (*L3Tier, error) {
	if key == nil {
		return nil, fmt.Errorf("L3 encryption needs the cluster's storage key (its payload keys are derived from it): %w", ErrConfig)
	}
	t := NewL3Tier(store, instance, key)
	t.encrypt = true
	return t, nil
}

// Name returns the object name of key.
func (t *L3Tier) Name(key dcp.Key) string { return nameOf(t.instance, key) }

// nameOf returns the object name of key under instance's prefix.
func nameOf(instance string, key dcp.Key) string {
	return instance + "/" + key.NS.String() + "/" + key.String() + FileExt
}

// Put stores payload under obj.Key; it returns once the store acknowledged
// the whole object.
func (t *L3Tier) Put(ctx context.Context, obj L2Object, payload []byte) error {
	if uint64(len(payload)) != obj.Size {
		return fmt.Errorf("L3 put %s: payload %d B, header says %d B: %w", obj.Key, len(payload), obj.Size, ErrIO)
	}
	if t.encrypt {
		return t.putEncrypted(ctx, obj, payload)
	}
	hdr := encodeHeader(obj, t.key)
	r := &twoPart{a: hdr, b: payload}
	if err := t.store.Put(ctx, t.Name(obj.Key), r, r.size()); err != nil {
		return fmt.Errorf("L3 put %s: %w", obj.Key, errors.Join(err, ErrIO))
	}
	return nil
}

// putEncrypted is Put of a format 3 object: a fresh random nonce in the
// MACed header, the payload sealed with the header as associated data.
func (t *L3Tier) putEncrypted(ctx context.Context, obj L2Object, payload []byte) error {
	aead, err := t.cipher.aead(t.instance, obj.Key.NS)
	if err != nil {
		return fmt.Errorf("L3 put %s: %w", obj.Key, errors.Join(err, ErrIO))
	}
	nonce := make([]byte, gcmNonceBytes)
	_, _ = rand.Read(nonce) // never fails (crypto/rand), or the process ends
	hdr := encodeHeaderNonce(obj, t.key, nonce)
	buf, done := getBuf(len(payload) + gcmTagBytes)
	defer done()
	r := &twoPart{a: hdr, b: aead.Seal(buf[:0], nonce, payload, hdr)}
	if err := t.store.Put(ctx, t.Name(obj.Key), r, r.size()); err != nil {
		return fmt.Errorf("L3 put %s: %w", obj.Key, errors.Join(err, ErrIO))
	}
	return nil
}

// twoPart reads a then b as one seekable stream without copying them (a
// client can then sign, checksum and retry the body: minio-go reads a
// seekable body twice instead of buffering it).
type twoPart struct {
	a, b []byte
	off  int64
}

func (p *twoPart) size() int64 { return int64(len(p.a) + len(p.b)) }

func (p *twoPart) ReadAt(dst []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("read at %d: negative offset: %w", off, ErrIO)
	}
	n := 0
	for n < len(dst) && off < p.size() {
		var src []byte
		if off < int64(len(p.a)) {
			src = p.a[off:]
		} else {
			src = p.b[off-int64(len(p.a)):]
		}
		k := copy(dst[n:], src)
		n += k
		off += int64(k)
	}
	if n < len(dst) {
		return n, io.EOF
	}
	return n, nil
}

func (p *twoPart) Read(dst []byte) (int, error) {
	if p.off >= p.size() {
		return 0, io.EOF
	}
	n, err := p.ReadAt(dst, p.off)
	p.off += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

func (p *twoPart) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekCurrent:
		off += p.off
	case io.SeekEnd:
		off += p.size()
	}
	if off < 0 {
		return p.off, fmt.Errorf("seek to %d: negative offset: %w", off, ErrIO)
	}
	p.off = off
	return off, nil
}

// Get reads key's object into dst after verifying, like FileTier.Get, its
// header, key, fingerprint fp, length len(dst) and payload kvsum64. A
// missing object gives ErrNotFound; one that fails gives a *CorruptError
// (Kept: it is not deleted here).
func (t *L3Tier) Get(ctx context.Context, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	return t.get(ctx, t.instance, key, fp, dst)
}

// GetOf is Get of the object another instance (a share-group member,
// docs/sharing.md) wrote under its own prefix of the same bucket: the same
// checks with the same storage key (the header MAC, C12), and an
// encrypted payload opened under that instance's payload key, as its
// writer sealed it. Whether this rank may read instance is the caller's
// decision (transfer.Config.L3SharedWith).
func (t *L3Tier) GetOf(ctx context.Context, instance string, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	return t.get(ctx, instance, key, fp, dst)
}

// get is Get of key's object under instance's prefix.
func (t *L3Tier) get(ctx context.Context, instance string, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	name := nameOf(instance, key)
	bad := func(o L2Object, writerKnown bool, why string) error { return badL3(name, key, o, writerKnown, why) }
	body, size, err := t.store.Open(ctx, name, 0, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return L2Object{}, fmt.Errorf("L3 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return L2Object{}, fmt.Errorf("L3 read %s: %w", key, errors.Join(err, ErrIO))
	}
	defer body.Close()
	hb, err := readHeaderBytes(body, size)
	if errors.Is(err, fs.ErrNotExist) { // deleted since the open
		return L2Object{}, fmt.Errorf("L3 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		if ctx.Err() != nil || !errors.Is(err, ErrCorrupt) {
			return L2Object{}, fmt.Errorf("L3 read %s: %w", key, errors.Join(err, ErrIO))
		}
		return L2Object{}, bad(L2Object{}, false, err.Error())
	}
	o, _, nonce, err := readObjHeader(bytes.NewReader(hb), size, t.key, true)
	switch {
	case errors.Is(err, ErrUnverified):
		return o, unverifiedL3(name, key, o, err)
	case err != nil:
		return o, bad(o, false, err.Error())
	case o.Key != key:
		return o, bad(o, true, "header names key "+o.Key.String())
	case o.Fingerprint != fp:
		return o, bad(o, true, fmt.Sprintf("layout fingerprint %x, namespace has %x", o.Fingerprint[:8], fp[:8]))
	case o.Size != uint64(len(dst)):
		return o, bad(o, true, fmt.Sprintf("payload %d B, the geometry says %d B", o.Size, len(dst)))
	}
	if nonce != nil {
		return o, t.getEncrypted(ctx, instance, key, o, hb, nonce, body, dst, bad)
	}
	if _, err := io.ReadFull(body, dst); errors.Is(err, fs.ErrNotExist) {
		return o, fmt.Errorf("L3 object %s deleted while read: %w", key, ErrNotFound)
	} else if err != nil {
		return o, fmt.Errorf("L3 read %s: payload: %w", key, errors.Join(err, ErrIO))
	}
	if sum := checksum.Sum(dst); sum != o.Sum {
		return o, bad(o, true, fmt.Sprintf("payload kvsum64 %016x, recorded %016x", sum, o.Sum))
	}
	return o, nil
}

// getEncrypted is the rest of Get for a format 3 object whose header hb
// (with nonce) was read and checked: the ciphertext and tag are read from
// body and opened into dst with the header as associated data, under the
// payload key of instance (whose prefix holds it), then the plaintext's
// kvsum64 is checked against the MACed sum; bad reports a failure.
func (t *L3Tier) getEncrypted(ctx context.Context, instance string, key dcp.Key, o L2Object, hb, nonce []byte, body io.Reader,
	dst []byte, bad func(L2Object, bool, string) error) error {
	aead, err := t.cipher.aead(instance, key.NS)
	if err != nil {
		return fmt.Errorf("L3 read %s: %w", key, errors.Join(err, ErrIO))
	}
	buf, done := getBuf(len(dst) + gcmTagBytes)
	defer done()
	if _, err := io.ReadFull(body, buf); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("L3 object %s deleted while read: %w", key, ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("L3 read %s: payload: %w", key, errors.Join(err, ErrIO))
	}
	if _, err := aead.Open(dst[:0], nonce, buf, hb); err != nil {
		return bad(o, true, "payload does not decrypt: its AES-256-GCM tag does not verify (ciphertext or tag altered, or the object was written for another instance or namespace)")
	}
	if sum := checksum.Sum(dst); sum != o.Sum {
		return bad(o, true, fmt.Sprintf("decrypted payload kvsum64 %016x, recorded %016x", sum, o.Sum))
	}
	return nil
}

// readHeaderBytes reads the header of an object of size bytes from r: its
// fixed prefix, then as many bytes as the prefix declares (bounded). A
// short or implausible header wraps ErrCorrupt.
func readHeaderBytes(r io.Reader, size int64) ([]byte, error) {
	var pre [8]byte
	if _, err := io.ReadFull(r, pre[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("object of %d B too short for a header: %w", size, ErrCorrupt)
		}
		return nil, err
	}
	h := int(binary.BigEndian.Uint16(pre[6:]))
	if string(pre[:4]) != fileMagic || h < fileMinHdr || h > fileMaxHdr || int64(h) > size {
		return nil, fmt.Errorf("bad header prefix (magic %q, header length %d, object %d B): %w", pre[:4], h, size, ErrCorrupt)
	}
	b := make([]byte, h)
	copy(b, pre[:])
	if _, err := io.ReadFull(r, b[8:]); err != nil {
		return nil, err
	}
	return b, nil
}

// unverifiedL3 reports key's object (named name), whose header MAC failed
// (cause), as a *CorruptError with Unverified and Kept: it stays in the
// bucket.
func unverifiedL3(name string, key dcp.Key, o L2Object, cause error) error {
	return &CorruptError{Key: key, Writer: o.Writer, WriterKnown: true, Path: "l3:" + name, Reason: cause.Error(),
		Unverified: true, Kept: true}
}

// badL3 reports key's object (named name), which failed a read's
// verification, as a *CorruptError with Kept: it stays in the bucket. A
// reader cannot tell whether the object's writer rewrote it since the read
// (the object stores used here have no conditional delete), so a delete
// could remove a valid rewrite while the writer's index entry still lists
// it; the engine of the rank that wrote the object removes or rewrites it
// (transfer/l3engine.go).
func badL3(name string, key dcp.Key, o L2Object, writerKnown bool, why string) error {
	return &CorruptError{Key: key, Writer: o.Writer, WriterKnown: writerKnown, Path: "l3:" + name, Reason: why, Kept: true}
}

// corrupt reports key's object, whose header failed the scan of its
// writer, as a *CorruptError, deleted.
func (t *L3Tier) corrupt(ctx context.Context, key dcp.Key, o L2Object, writerKnown bool, why string) error {
	ce := &CorruptError{Key: key, Writer: o.Writer, WriterKnown: writerKnown, Path: "l3:" + t.Name(key), Reason: why}
	if err := t.store.Delete(ctx, t.Name(key)); err == nil {
		ce.Deleted = true
	}
	return ce
}

// Delete removes key's object; a missing one is not an error.
func (t *L3Tier) Delete(ctx context.Context, key dcp.Key) error {
	if err := t.store.Delete(ctx, t.Name(key)); err != nil {
		return fmt.Errorf("L3 delete %s: %w", key, errors.Join(err, ErrIO))
	}
	return nil
}

// Scan calls fn for every object of the instance whose header names owner
// as its writer, reading only headers (a ranged read of each object of
// owner's shard: the writer TP rank is the shard, dcp.StoreShard). Objects
// whose header fails are deleted and reported with Err (KeyKnown); those
// whose header MAC does not verify (C12) are left in the bucket and
// reported with an Err wrapping ErrUnverified, to be counted and never
// announced. An object whose header cannot be read (an I/O error, not a bad header) does
// not stop the scan: it is read once more after the listing, and those
// that fail again are left out and named in the error Scan returns, with
// the objects after them scanned.
func (t *L3Tier) Scan(ctx context.Context, owner wire.Rank, fn func(ScanEntry)) error {
	type skip struct {
		name string
		size int64
	}
	var skipped []skip
	err := t.store.List(ctx, t.instance+"/", func(name string, size int64) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := t.scanOne(ctx, owner, name, size, fn); err != nil {
			if len(skipped) >= maxScanSkips {
				return fmt.Errorf("L3 scan: %d objects unreadable, stopped at %s: %w", len(skipped)+1, name, err)
			}
			skipped = append(skipped, skip{name, size})
		}
		return nil
	})
	if err != nil {
		return err
	}
	var failed []error
	for _, sk := range skipped {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := t.scanOne(ctx, owner, sk.name, sk.size, fn); err != nil {
			failed = append(failed, err)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("L3 scan: %d of its objects unreadable twice, left out (first: %w)", len(failed), failed[0])
	}
	return nil
}

// maxScanSkips bounds the unreadable objects one Scan sets aside before it
// gives up on the bucket.
const maxScanSkips = 1024

// scanOne is Scan's work on one listed object; an error is an I/O error
// reading its header (the object is neither reported nor deleted).
func (t *L3Tier) scanOne(ctx context.Context, owner wire.Rank, name string, size int64, fn func(ScanEntry)) error {
	rest := strings.TrimPrefix(name, t.instance+"/")
	nsPart, file, ok := strings.Cut(rest, "/")
	if !ok || !strings.HasSuffix(file, FileExt) {
		return nil // not an object of ours
	}
	key, err := dcp.ParseKey(strings.TrimSuffix(file, FileExt))
	if err != nil || key.NS.String() != nsPart || int(key.Shard) != owner.TPRank {
		return nil
	}
	if size <= 0 {
		// No header to read (a ranged read of an empty object is
		// refused, 416): corrupt, deleted, and the scan goes on.
		fn(ScanEntry{Object: L2Object{Key: key}, KeyKnown: true,
			Err: t.corrupt(ctx, key, L2Object{Key: key}, false, "empty object: no header")})
		return nil
	}
	body, _, err := t.store.Open(ctx, name, 0, min(size, int64(fileMaxHdr)))
	if errors.Is(err, fs.ErrNotExist) {
		return nil // deleted since the listing
	}
	if err != nil {
		return fmt.Errorf("L3 scan %s: %w", name, errors.Join(err, ErrIO))
	}
	hb, err := readHeaderBytes(body, size)
	body.Close()
	if err != nil && !errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("L3 scan %s: %w", name, errors.Join(err, ErrIO))
	}
	var o L2Object
	if err == nil {
		o, _, _, err = readObjHeader(bytes.NewReader(hb), size, t.key, true)
	}
	if (err == nil || errors.Is(err, ErrUnverified)) && o.Writer != owner {
		return nil
	}
	if errors.Is(err, ErrUnverified) {
		o.Key = key
		fn(ScanEntry{Object: o, KeyKnown: true, WriterKnown: true, Err: unverifiedL3(name, key, o, err)})
		return nil
	}
	if err == nil && o.Key != key {
		err = fmt.Errorf("header names key %s", o.Key)
	}
	if err != nil {
		o.Key = key
		fn(ScanEntry{Object: o, KeyKnown: true, Err: t.corrupt(ctx, key, o, false, err.Error())})
		return nil
	}
	fn(ScanEntry{Object: o, KeyKnown: true, WriterKnown: true})
	return nil
}
