package dcp

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
)

// Namespace identifies a model + cache salt + layout fingerprint: the first
// 16 bytes of SHA-256("kvtier/ns/v1", model, salt, fingerprint). Objects in
// different namespaces never share bytes (C4).
type Namespace [16]byte

// ChunkHash identifies a chunk of tokens and every token before it.
type ChunkHash [16]byte

func newNamespace(model, salt string, fp [32]byte) Namespace {
	h := sha256.New()
	var n [8]byte
	h.Write([]byte("kvtier/ns/v1"))
	for _, s := range []string{model, salt} {
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	h.Write(fp[:])
	var ns Namespace
	copy(ns[:], h.Sum(nil))
	return ns
}

func (n Namespace) String() string { return hex.EncodeToString(n[:]) }
func (c ChunkHash) String() string { return hex.EncodeToString(c[:]) }

// ParseNamespace parses 32 lowercase hex digits.
func ParseNamespace(s string) (Namespace, error) {
	var n Namespace
	return n, parseHex16(s, n[:], "namespace")
}

// ParseChunkHash parses 32 lowercase hex digits.
func ParseChunkHash(s string) (ChunkHash, error) {
	var c ChunkHash
	return c, parseHex16(s, c[:], "chunk hash")
}

func parseHex16(s string, dst []byte, what string) error {
	if len(s) != 32 {
		return fmt.Errorf("%s %q: want 32 hex digits, got %d characters: %w", what, clip(s), len(s), ErrKey)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return fmt.Errorf("%s %q: character %d is not a lowercase hex digit: %w", what, clip(s), i, ErrKey)
		}
	}
	_, err := hex.Decode(dst, []byte(s))
	return err
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}

// ChunkHashes returns the prefix-chained hashes of every full chunk of
// tokens: h_k = SHA-256(h_{k-1} || chunk k as little-endian uint32s)[:16],
// with h_{-1} = the namespace. A trailing partial chunk gets no hash.
//
// SHA-256 because a collision would restore another prompt's KV, silently
// and possibly across tenants: the hash must be collision resistant, not
// just well mixed. 128 bits keep keys small and collisions out of reach;
// hardware SHA extensions hash tokens far faster than an engine makes them.
func ChunkHashes(ns Namespace, tokens []uint32, chunkTokens int) []ChunkHash {
	if chunkTokens < 1 {
		return nil
	}
	n := len(tokens) / chunkTokens
	out := make([]ChunkHash, 0, n)
	prev := [16]byte(ns)
	buf := make([]byte, 16+4*chunkTokens)
	for k := range n {
		copy(buf, prev[:])
		for i, t := range tokens[k*chunkTokens : (k+1)*chunkTokens] {
			binary.LittleEndian.PutUint32(buf[16+4*i:], t)
		}
		sum := sha256.Sum256(buf)
		copy(prev[:], sum[:16])
		out = append(out, ChunkHash(prev))
	}
	return out
}

// Key names one stored object: a shard of one group of one chunk.
//
// Binary encoding (KeySize bytes, big-endian, sorts by namespace, then
// chunk, shard, group):
//
//	[0]      version, 1
//	[1:17]   namespace
//	[17:33]  chunk hash
//	[33:35]  shard
//	[35:37]  object group
//
// Text encoding: "<namespace hex>.<chunk hex>.<shard>.<group>", lowercase
// hex, decimal without leading zeros, e.g. "00ff...7a.1c2d...09.3.0". It is
// safe in file names and NATS subjects.
type Key struct {
	NS    Namespace
	Chunk ChunkHash
	Shard uint16
	Group uint16
}

// KeySize is the length of a binary Key.
const KeySize = 37

const keyVersion = 1

// AppendBinary appends the binary encoding of k.
func (k Key) AppendBinary(b []byte) ([]byte, error) {
	b = append(b, keyVersion)
	b = append(b, k.NS[:]...)
	b = append(b, k.Chunk[:]...)
	b = binary.BigEndian.AppendUint16(b, k.Shard)
	return binary.BigEndian.AppendUint16(b, k.Group), nil
}

// MarshalBinary returns the binary encoding of k.
func (k Key) MarshalBinary() ([]byte, error) { return k.AppendBinary(make([]byte, 0, KeySize)) }

// Bytes returns the binary encoding of k.
func (k Key) Bytes() []byte { b, _ := k.MarshalBinary(); return b }

// UnmarshalBinary decodes a binary key.
func (k *Key) UnmarshalBinary(b []byte) error {
	if len(b) != KeySize {
		return fmt.Errorf("binary key is %d bytes, want %d: %w", len(b), KeySize, ErrKey)
	}
	if b[0] != keyVersion {
		return fmt.Errorf("binary key version %d, want %d: %w", b[0], keyVersion, ErrKey)
	}
	copy(k.NS[:], b[1:17])
	copy(k.Chunk[:], b[17:33])
	k.Shard = binary.BigEndian.Uint16(b[33:35])
	k.Group = binary.BigEndian.Uint16(b[35:37])
	return nil
}

// String returns the text encoding of k.
func (k Key) String() string {
	return k.NS.String() + "." + k.Chunk.String() + "." +
		strconv.Itoa(int(k.Shard)) + "." + strconv.Itoa(int(k.Group))
}

// MarshalText implements encoding.TextMarshaler (keys travel as JSON text).
func (k Key) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (k *Key) UnmarshalText(b []byte) error {
	p, err := ParseKey(string(b))
	if err != nil {
		return err
	}
	*k = p
	return nil
}

// ParseKey parses the text encoding of a key; it accepts exactly what
// String produces.
func ParseKey(s string) (Key, error) {
	parts := strings.Split(s, ".")
	if len(parts) != 4 {
		return Key{}, fmt.Errorf("key %q has %d dot-separated fields, want 4 (ns.chunk.shard.group): %w",
			clip(s), len(parts), ErrKey)
	}
	var k Key
	var err error
	if k.NS, err = ParseNamespace(parts[0]); err != nil {
		return Key{}, err
	}
	if k.Chunk, err = ParseChunkHash(parts[1]); err != nil {
		return Key{}, err
	}
	if k.Shard, err = parseU16(parts[2], "shard"); err != nil {
		return Key{}, err
	}
	if k.Group, err = parseU16(parts[3], "object group"); err != nil {
		return Key{}, err
	}
	return k, nil
}

func parseU16(s, what string) (uint16, error) {
	if s == "" || len(s) > 5 || (len(s) > 1 && s[0] == '0') {
		return 0, fmt.Errorf("%s %q: want a decimal 0..65535 without leading zeros: %w", what, clip(s), ErrKey)
	}
	v := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%s %q: want a decimal 0..65535 without leading zeros: %w", what, clip(s), ErrKey)
		}
		v = v*10 + int(c-'0')
	}
	if v > 65535 {
		return 0, fmt.Errorf("%s %d exceeds 65535: %w", what, v, ErrKey)
	}
	return uint16(v), nil
}

// MarshalText encodes a namespace as 32 lowercase hex digits (JSON strings).
func (n Namespace) MarshalText() ([]byte, error) { return []byte(n.String()), nil }

// UnmarshalText parses 32 lowercase hex digits.
func (n *Namespace) UnmarshalText(b []byte) error {
	v, err := ParseNamespace(string(b))
	if err != nil {
		return err
	}
	*n = v
	return nil
}

// MarshalText encodes a chunk hash as 32 lowercase hex digits.
func (c ChunkHash) MarshalText() ([]byte, error) { return []byte(c.String()), nil }

// UnmarshalText parses 32 lowercase hex digits.
func (c *ChunkHash) UnmarshalText(b []byte) error {
	v, err := ParseChunkHash(string(b))
	if err != nil {
		return err
	}
	*c = v
	return nil
}
