package tier

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
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
	// Skipped, when not empty, says why an entry of the tier was left
	// alone: not a regular file (a FIFO, a device, a symlink) or a
	// namespace directory that is a symlink. Nothing else is set.
	Skipped string
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
	// unknown. An object whose header MAC does not verify with the tier's
	// storage key (C12) is quarantined too and reported with an Err
	// wrapping ErrUnverified: never announce it. Leftovers of owner's
	// interrupted writes are removed.
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
	// Deleted: the object was removed instead of moved aside (an L3
	// object: a bucket has no cheap rename).
	Deleted bool
	// Unverified: the header's MAC did not verify (ErrUnverified, C12).
	// An unverified L3 object is left in the bucket (Kept): a wrong key
	// must not empty a bucket; it is never announced nor served.
	Unverified bool
	Kept       bool
}

func (e *CorruptError) Error() string {
	s := "L2 object " + e.Key.String() + " at " + e.Path + ": " + e.Reason
	switch {
	case e.Deleted:
		s = "L3 object " + e.Key.String() + " at " + e.Path + ": " + e.Reason + " (deleted)"
	case e.Kept:
		s = "L3 object " + e.Key.String() + " at " + e.Path + ": " + e.Reason + " (left in the bucket, not served)"
	case e.Quarantine != "":
		s += " (quarantined to " + e.Quarantine + ")"
	default:
		s += " (quarantine failed)"
	}
	return s
}

// Is makes errors.Is(err, ErrCorrupt) true, and errors.Is(err,
// ErrUnverified) for an object whose header MAC failed.
func (e *CorruptError) Is(target error) bool {
	return target == ErrCorrupt || e.Unverified && target == ErrUnverified
}

// Object file format (version 2), all integers big-endian:
//
//	[0:4]      magic "KVTO"
//	[4:6]      version, 2
//	[6:8]      header length H (bytes, including MAC and header checksum)
//	[8:45]     key (dcp binary key)
//	[45:77]    layout fingerprint
//	[77:85]    payload length
//	[85:93]    payload kvsum64
//	[93:101]   writer incarnation
//	[101:109]  created, Unix nanoseconds
//	[109:113]  writer TP rank
//	[113]      writer instance length n (<= 64)
//	[114:114+n] writer instance
//	[H-40:H-8] MAC: HMAC-SHA256(storage key, "kvtier object header v2\x00"
//	           || bytes [0, H-40)), zero when written without a key
//	[H-8:H]    kvsum64 of header bytes [0, H-8)
//	[H:]       payload, exactly payload length bytes
//
// The MAC covers every header field (key, fingerprint, length, payload
// sum, writer, created), so a header that verifies was written by a holder
// of the cluster's storage key (C12): nobody else can pair other bytes
// with a matching sum. The header checksum stays to tell a torn or
// bit-flipped header (ErrCorrupt) from a well-formed one whose MAC fails
// (ErrUnverified). Version 1 is the same without the MAC (H = 114+n+8);
// it is read, but with a key it is unverified.
//
// A file is written to a temporary name in its directory, fsynced, renamed
// into place and the directory fsynced, so a crash leaves either the old
// state or the whole new file; torn files can only come from the storage
// itself, and the checksums catch them.
//
// FileExt, TmpPrefix and QuarantineDir name an object file, a temporary
// file of a write and the directory of quarantined files beneath the root.
const (
	fileMagic     = "KVTO"
	fileVersion   = 2
	fileVersion1  = 1
	fileFixedHdr  = 114
	fileMinHdr    = fileFixedHdr + 8                               // version 1, empty instance
	fileMaxHdr    = fileFixedHdr + 64 + encHdrExtra + macBytes + 8 // format 3
	FileExt       = ".kvo"
	TmpPrefix     = ".tmp."
	QuarantineDir = "quarantine"
)

// HeaderBytes is the length of the header of an object file written by
// an instance named instance (the bytes a file holds beyond its payload).
func HeaderBytes(instance string) uint64 { return uint64(fileFixedHdr + len(instance) + macBytes + 8) }

// encodeHeader returns o's version 2 header, MACed with key (zero MAC for
// a nil key).
func encodeHeader(o L2Object, key *MACKey) []byte { return encodeHeaderNonce(o, key, nil) }

// encodeHeaderNonce returns o's header: version 2 for a nil nonce,
// version 3 (an encrypted L3 object, l3crypt.go) with the cipher id and
// nonce before the MAC otherwise.
func encodeHeaderNonce(o L2Object, key *MACKey, nonce []byte) []byte {
	version, extra := fileVersion, 0
	if nonce != nil {
		version, extra = fileVersionEnc, 1+len(nonce)
	}
	h := fileFixedHdr + len(o.Writer.Instance) + extra + macBytes + 8
	b := make([]byte, 0, h)
	b = append(b, fileMagic...)
	b = binary.BigEndian.AppendUint16(b, uint16(version))
	b = binary.BigEndian.AppendUint16(b, uint16(h))
	b, _ = o.Key.AppendBinary(b)
	b = append(b, o.Fingerprint[:]...)
	b = binary.BigEndian.AppendUint64(b, o.Size)
	b = binary.BigEndian.AppendUint64(b, o.Sum)
	b = binary.BigEndian.AppendUint64(b, o.Incarnation)
	b = binary.BigEndian.AppendUint64(b, uint64(o.Created.UnixNano()))
	b = binary.BigEndian.AppendUint32(b, uint32(o.Writer.TPRank))
	b = append(b, byte(len(o.Writer.Instance)))
	b = append(b, o.Writer.Instance...)
	if nonce != nil {
		b = append(append(b, cipherAES256GCM), nonce...)
	}
	mac := key.sum(b)
	b = append(b, mac[:]...)
	return binary.BigEndian.AppendUint64(b, checksum.Sum(b))
}

// readHeader reads and verifies the header of an open object file of
// fileSize bytes: its form and checksum, the file's length, then its MAC
// with key. It returns the header length h > 0 once the fields are read
// (the writer is then known, though unverified when the MAC fails); a MAC
// that does not verify, or a version 1 header (no MAC) when key is set,
// gives an error wrapping ErrUnverified with the header's fields.
func readHeader(f io.ReaderAt, fileSize int64, key *MACKey) (L2Object, int, error) {
	o, h, _, err := readObjHeader(f, fileSize, key, false)
	return o, h, err
}

// readObjHeader is readHeader that, with encrypted set (the L3 tier), also
// takes format 3 and returns its nonce (nil for a format 1 or 2 header): a
// format 3 object is the header, the payload's length in ciphertext and a
// GCM tag.
func readObjHeader(f io.ReaderAt, fileSize int64, key *MACKey, encrypted bool) (L2Object, int, []byte, error) {
	var o L2Object
	var pre [8]byte
	if _, err := f.ReadAt(pre[:], 0); err != nil {
		return o, 0, nil, fmt.Errorf("file of %d B too short for a header: %w", fileSize, err)
	}
	if string(pre[:4]) != fileMagic {
		return o, 0, nil, fmt.Errorf("bad magic %q, want %q", pre[:4], fileMagic)
	}
	v := binary.BigEndian.Uint16(pre[4:])
	macLen, extra := 0, 0
	switch {
	case v == fileVersion:
		macLen = macBytes
	case v == fileVersion1:
	case v == fileVersionEnc && encrypted:
		macLen, extra = macBytes, encHdrExtra
	case v == fileVersionEnc:
		return o, 0, nil, fmt.Errorf("format version %d (an encrypted L3 object) in an L2 file", v)
	default:
		return o, 0, nil, fmt.Errorf("format version %d, want %d (or %d)", v, fileVersion, fileVersion1)
	}
	h := int(binary.BigEndian.Uint16(pre[6:]))
	if lo, hi := fileFixedHdr+extra+macLen+8, fileFixedHdr+64+extra+macLen+8; h < lo || h > hi {
		return o, 0, nil, fmt.Errorf("header length %d outside %d..%d", h, lo, hi)
	}
	b := make([]byte, h)
	if _, err := f.ReadAt(b, 0); err != nil {
		return o, 0, nil, fmt.Errorf("header of %d B truncated in a %d B file: %w", h, fileSize, err)
	}
	if got, want := checksum.Sum(b[:h-8]), binary.BigEndian.Uint64(b[h-8:]); got != want {
		return o, 0, nil, fmt.Errorf("header checksum %016x, recorded %016x", got, want)
	}
	n := int(b[113])
	if fileFixedHdr+n+extra+macLen+8 != h {
		return o, 0, nil, fmt.Errorf("writer instance of %d B does not fit header length %d", n, h)
	}
	var nonce []byte
	if extra > 0 {
		if c := b[fileFixedHdr+n]; c != cipherAES256GCM {
			return o, 0, nil, fmt.Errorf("cipher id %d, want %d (AES-256-GCM)", c, cipherAES256GCM)
		}
		nonce = b[fileFixedHdr+n+1 : fileFixedHdr+n+extra]
	}
	if err := o.Key.UnmarshalBinary(b[8:45]); err != nil {
		return o, 0, nil, err
	}
	copy(o.Fingerprint[:], b[45:77])
	o.Size = binary.BigEndian.Uint64(b[77:])
	o.Sum = binary.BigEndian.Uint64(b[85:])
	o.Incarnation = binary.BigEndian.Uint64(b[93:])
	o.Created = time.Unix(0, int64(binary.BigEndian.Uint64(b[101:])))
	o.Writer.TPRank = int(binary.BigEndian.Uint32(b[109:]))
	o.Writer.Instance = string(b[114 : 114+n])
	tag := 0
	if nonce != nil {
		tag = gcmTagBytes
	}
	if want := int64(h) + int64(o.Size) + int64(tag); o.Size > 1<<50 || fileSize != want {
		if tag > 0 {
			return o, h, nil, fmt.Errorf("file is %d B, header %d B + payload %d B + GCM tag %d B = %d B", fileSize, h, o.Size, tag, want)
		}
		return o, h, nil, fmt.Errorf("file is %d B, header %d B + payload %d B = %d B", fileSize, h, o.Size, want)
	}
	if key == nil && nonce != nil {
		return o, h, nil, fmt.Errorf("an encrypted object, and this rankd has no storage key to open it: %w", ErrUnverified)
	}
	if key != nil {
		if v == fileVersion1 {
			return o, h, nil, fmt.Errorf("format version 1 carries no MAC (written before storage MACs): %w", ErrUnverified)
		}
		if end := fileFixedHdr + n + extra; !key.verify(b[:end], b[end:end+macBytes]) {
			return o, h, nil, fmt.Errorf("header MAC does not verify with this cluster's storage key (another cluster's or a rotated key, or forged): %w", ErrUnverified)
		}
	}
	return o, h, nonce, nil
}
