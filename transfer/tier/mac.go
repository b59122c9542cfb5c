package tier

import (
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
)

// MACKey is the cluster's storage MAC key (C12): object headers written
// with it carry HMAC-SHA256(key, macDomain || header fields), so a scan
// announces only objects this cluster wrote, with the checksum it
// recorded. The key lives in the credentials directory (auth's
// storage.key), never beside the objects. A nil *MACKey is the insecure
// mode: headers carry a zero MAC and none is checked (storage is
// trusted); rankd allows it only with --insecure.
type MACKey struct {
	key []byte
}

// MinMACKeyBytes is the shortest storage key NewMACKey accepts (the
// HMAC-SHA256 block's security level).
const MinMACKeyBytes = 32

// macBytes is the length of the MAC in a header.
const macBytes = sha256.Size

// macDomain separates object-header MACs from any other use of the key.
const macDomain = "kvtier object header v2\x00"

// NewMACKey returns the MAC key of secret (at least MinMACKeyBytes; the
// bytes are copied).
func NewMACKey(secret []byte) (*MACKey, error) {
	if len(secret) < MinMACKeyBytes {
		return nil, fmt.Errorf("storage MAC key of %d B, want at least %d B: %w", len(secret), MinMACKeyBytes, ErrConfig)
	}
	return &MACKey{key: append([]byte(nil), secret...)}, nil
}

// sum returns the MAC of the header fields b (the header up to the MAC);
// zero for a nil key.
func (k *MACKey) sum(b []byte) (out [macBytes]byte) {
	if k == nil {
		return out
	}
	m := hmac.New(sha256.New, k.key)
	m.Write([]byte(macDomain))
	m.Write(b)
	m.Sum(out[:0])
	return out
}

// verify reports whether mac is the MAC of b; always true for a nil key
// (insecure: headers are trusted).
func (k *MACKey) verify(b, mac []byte) bool {
	if k == nil {
		return true
	}
	want := k.sum(b)
	return hmac.Equal(want[:], mac)
}
