package checksum

import (
	"encoding/binary"
)

// Constants of kvsum64. Changing any of them changes every recorded checksum:
// they are part of the on-disk and on-wire format.
const (
	K1 = 0x9E3779B97F4A7C15
	K2 = 0xC2B2AE3D27D4EB4F
	m1 = 0xff51afd7ed558ccd
	m2 = 0xc4ceb9fe1a85ec53
)

// fmix64 is the MurmurHash3 finalizer: a bijection on uint64.
func fmix64(x uint64) uint64 {
	x ^= x >> 33
	x *= m1
	x ^= x >> 33
	x *= m2
	x ^= x >> 33
	return x
}

// Term is the contribution of the 8-byte word w at word index i.
func Term(i, w uint64) uint64 { return fmix64(w ^ (i*K1 + K2)) }

// Finish turns a full partial sum over an object of n bytes into its digest.
func Finish(partial, n uint64) uint64 { return fmix64(partial ^ (n * K2) ^ K1) }

// Partial returns the partial sum of p, where p starts at byte offset off of
// the object. off must be a multiple of 8; if len(p) is not a multiple of 8,
// p must be the object's tail (the last word is zero-padded).
func Partial(p []byte, off uint64) uint64 {
	if off%8 != 0 {
		panic("checksum: piece offset not 8-byte aligned")
	}
	i := off / 8
	var sum uint64
	for len(p) >= 32 {
		sum += Term(i, binary.LittleEndian.Uint64(p)) +
			Term(i+1, binary.LittleEndian.Uint64(p[8:])) +
			Term(i+2, binary.LittleEndian.Uint64(p[16:])) +
			Term(i+3, binary.LittleEndian.Uint64(p[24:]))
		p = p[32:]
		i += 4
	}
	for len(p) >= 8 {
		sum += Term(i, binary.LittleEndian.Uint64(p))
		p = p[8:]
		i++
	}
	if len(p) > 0 {
		var tail [8]byte
		copy(tail[:], p)
		sum += Term(i, binary.LittleEndian.Uint64(tail[:]))
	}
	return sum
}

// Sum returns the kvsum64 digest of a whole object.
func Sum(p []byte) uint64 { return Finish(Partial(p, 0), uint64(len(p))) }

// Digest accumulates an object streamed in pieces of any size, in order.
// The zero value is ready to use.
type Digest struct {
	sum  uint64
	n    uint64
	buf  [8]byte
	nbuf int
}

// Write adds p; it never fails.
func (d *Digest) Write(p []byte) (int, error) {
	written := len(p)
	if d.nbuf > 0 {
		c := copy(d.buf[d.nbuf:], p)
		d.nbuf += c
		p = p[c:]
		if d.nbuf < 8 {
			return written, nil
		}
		d.sum += Term(d.n/8, binary.LittleEndian.Uint64(d.buf[:]))
		d.n += 8
		d.nbuf = 0
	}
	whole := len(p) &^ 7
	if whole > 0 {
		d.sum += Partial(p[:whole], d.n)
		d.n += uint64(whole)
		p = p[whole:]
	}
	d.nbuf = copy(d.buf[:], p)
	return written, nil
}

// Sum64 returns the digest of everything written so far.
func (d *Digest) Sum64() uint64 {
	sum := d.sum
	if d.nbuf > 0 {
		var tail [8]byte
		copy(tail[:], d.buf[:d.nbuf])
		sum += Term(d.n/8, binary.LittleEndian.Uint64(tail[:]))
	}
	return Finish(sum, d.n+uint64(d.nbuf))
}

// Len returns the number of bytes written.
func (d *Digest) Len() uint64 { return d.n + uint64(d.nbuf) }
