package tier

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"fmt"
	"sync"

	"github.com/kvtier/kvtier/dcp"
)

// L3 payload encryption at rest (optional; docs/storage-encryption.md).
//
// An encrypting L3 tier (NewEncryptingL3Tier) writes objects of format
// version 3: the version 2 header with two more MACed fields, a cipher id
// (1: AES-256-GCM) and a 96-bit nonce, then the payload sealed with
// AES-256-GCM: ciphertext (as long as the payload) and a 16-byte tag. The
// associated data is the whole header (fields, MAC and header checksum),
// so a ciphertext opens only under the header it was written with.
//
// Keys. The payload key of an object is HKDF-SHA256 of the cluster's
// storage key (auth's storage.key, the MAC key: in the credentials
// directory, never in the bucket) with salt encSalt, expanded with the
// tier's instance and the object's namespace: one key per instance and
// namespace, so an object copied to another instance's prefix or named
// into another namespace does not open. The derivation is domain-separated
// from the header MAC (HMAC keyed with the storage key itself over
// macDomain), so neither reveals the other.
//
// Nonces are 96 random bits from crypto/rand per write. GCM's nonces must
// never repeat under one key; with random nonces the chance of any repeat
// among q writes of one instance's namespace is below q²/2^97: 2^-33 after
// 2^32 writes (4 PiB of 1 MiB objects in one namespace), the bound NIST SP
// 800-38D sets for random nonces. A derived nonce (a counter) would need
// state that survives restarts and is shared by every rank of the
// instance; random needs none.
//
// A header whose MAC verifies but whose payload does not open (a flipped
// ciphertext or tag byte, a copy to another instance's prefix) is corrupt
// like a payload whose kvsum64 differs: the read fails, and the chunk
// fails and is counted. Without a storage key (the
// insecure mode) a format 3 object cannot be opened: it is unverified and
// left in the bucket. The L2 tier never writes or accepts format 3.

const (
	fileVersionEnc  = 3
	cipherAES256GCM = 1  // the only cipher id
	gcmNonceBytes   = 12 // 96-bit nonce
	gcmTagBytes     = 16
	encHdrExtra     = 1 + gcmNonceBytes // cipher id and nonce in a format 3 header
	encSalt         = "kvtier L3 payload encryption v1"
)

// EncryptedHeaderBytes is the header length of a format 3 (encrypted)
// object written by an instance named instance; the object holds this,
// then the payload's length in ciphertext, then a 16-byte tag.
func EncryptedHeaderBytes(instance string) uint64 {
	return HeaderBytes(instance) + encHdrExtra
}

// payloadCipher derives the AES-256-GCM payload keys of a storage key.
type payloadCipher struct {
	prk []byte // HKDF-Extract(SHA-256, storage key, encSalt)
}

func newPayloadCipher(k *MACKey) *payloadCipher {
	prk, err := hkdf.Extract(sha256.New, k.key, []byte(encSalt))
	if err != nil { // only for a hash with a size HKDF refuses
		panic(err)
	}
	return &payloadCipher{prk: prk}
}

// aead returns the AES-256-GCM of instance's namespace ns.
func (c *payloadCipher) aead(instance string, ns dcp.Namespace) (cipher.AEAD, error) {
	info := "kvtier L3 payload AES-256-GCM\x00" + instance + "\x00" + string(ns[:])
	key, err := hkdf.Expand(sha256.New, c.prk, info, 32)
	if err != nil {
		return nil, fmt.Errorf("derive the L3 payload key: %w", err)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("L3 payload cipher: %w", err)
	}
	return cipher.NewGCM(block)
}

// sealBufs holds ciphertext buffers between writes and reads (objects are
// MBs: one per write and per read otherwise).
var sealBufs sync.Pool

// getBuf returns a buffer of n bytes (its content undefined) and the
// function that gives it back.
func getBuf(n int) ([]byte, func()) {
	if p, ok := sealBufs.Get().(*[]byte); ok && cap(*p) >= n {
		return (*p)[:n], func() { sealBufs.Put(p) }
	}
	b := make([]byte, n)
	return b, func() { sealBufs.Put(&b) }
}
