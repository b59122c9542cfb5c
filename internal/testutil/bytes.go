package testutil

import "math/rand/v2"

// RandomBytes returns n bytes drawn from a ChaCha8 stream seeded by seed:
// the same n and seed always give the same bytes, different seeds give
// unrelated ones.
func RandomBytes(n uint64, seed uint64) []byte {
	b := make([]byte, n)
	var s [32]byte
	for i := range 8 {
		s[i] = byte(seed >> (8 * i))
	}
	rand.NewChaCha8(s).Read(b)
	return b
}
