// Package checksum defines kvsum64, the one checksum kvtier records for every
// object's packed bytes and verifies on every restore (contract C5).
//
// kvsum64 is built to be computed in parallel pieces and combined, so a GPU
// gather kernel can produce it while it copies and a scatter kernel can verify
// it while it places bytes:
//
//	words   w_i = little-endian uint64 of bytes [8i, 8i+8), the last one zero-padded
//	term    t_i = fmix64(w_i XOR (i*K1 + K2))           (all arithmetic mod 2^64)
//	partial P   = sum of t_i over any subset of words     (wrapping add)
//	digest  H   = fmix64(P XOR (n*K2) XOR K1)            n = length in bytes
//
// fmix64 is the MurmurHash3 64-bit finalizer, a bijection, so changing any one
// word always changes the digest; the word index in each term makes the sum
// order-sensitive; the length in the digest tells trailing zero bytes apart.
// Pieces must start at an 8-byte-aligned offset of the object. It is not a
// cryptographic hash and must never be used where an adversary chooses bytes.
//
// The package owns the definition and its Go implementation; it never does I/O.
package checksum
