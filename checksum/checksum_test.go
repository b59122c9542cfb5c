package checksum

import (
	"math/rand/v2"
	"strconv"
	"testing"
)

// reference computes kvsum64 straight from the definition in doc.go, one
// byte at a time, sharing no code with the implementation but fmix64.
func reference(p []byte) uint64 {
	var sum uint64
	for i := 0; i*8 < len(p); i++ {
		var w uint64
		for k := 0; k < 8 && i*8+k < len(p); k++ {
			w |= uint64(p[i*8+k]) << (8 * k)
		}
		sum += fmix64(w ^ (uint64(i)*K1 + K2))
	}
	return fmix64(sum ^ (uint64(len(p)) * K2) ^ K1)
}

func TestVectors(t *testing.T) {
	for _, v := range Vectors {
		in := VectorInput(v.N)
		if got := Sum(in); got != v.Sum {
			t.Errorf("Sum(VectorInput(%d)) = %#016x, want %#016x", v.N, got, v.Sum)
		}
		if got := reference(in); got != v.Sum {
			t.Errorf("reference(VectorInput(%d)) = %#016x, want %#016x", v.N, got, v.Sum)
		}
	}
}

func TestMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		p := make([]byte, r.IntN(3000))
		for k := range p {
			p[k] = byte(r.Uint32())
		}
		if got, want := Sum(p), reference(p); got != want {
			t.Fatalf("len %d: Sum %#x != reference %#x", len(p), got, want)
		}
	}
}

// Pieces at 8-byte-aligned offsets, summed in any order, give the digest.
func TestPiecesCombineInAnyOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		p := make([]byte, 1+r.IntN(5000))
		for k := range p {
			p[k] = byte(r.Uint32())
		}
		var cuts []int
		for off := 0; off < len(p); {
			cuts = append(cuts, off)
			off += 8 * (1 + r.IntN(40))
		}
		r.Shuffle(len(cuts), func(a, b int) { cuts[a], cuts[b] = cuts[b], cuts[a] })
		var sum uint64
		for _, c := range cuts {
			end := len(p)
			for _, d := range cuts {
				if d > c && d < end {
					end = d
				}
			}
			sum += Partial(p[c:end], uint64(c))
		}
		if got, want := Finish(sum, uint64(len(p))), Sum(p); got != want {
			t.Fatalf("len %d: combined %#x != whole %#x", len(p), got, want)
		}
	}
}

func TestDigestStreamsAnySplit(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 300 {
		p := make([]byte, r.IntN(4000))
		for k := range p {
			p[k] = byte(r.Uint32())
		}
		var d Digest
		for rest := p; len(rest) > 0; {
			n := min(len(rest), r.IntN(37))
			d.Write(rest[:n])
			rest = rest[n:]
		}
		if d.Len() != uint64(len(p)) {
			t.Fatalf("Len %d != %d", d.Len(), len(p))
		}
		if got, want := d.Sum64(), Sum(p); got != want {
			t.Fatalf("len %d: streamed %#x != whole %#x", len(p), got, want)
		}
	}
}

// Every single-byte change, every swap of two different words and every
// length change (trailing zero bytes included) changes the digest.
func TestDetectsChanges(t *testing.T) {
	p := VectorInput(561)
	base := Sum(p)
	for k := range p {
		for _, flip := range []byte{0x01, 0x80, 0xff} {
			q := append([]byte(nil), p...)
			q[k] ^= flip
			if Sum(q) == base {
				t.Fatalf("flip %#x at byte %d not detected", flip, k)
			}
		}
	}
	q := append([]byte(nil), p...)
	copy(q[0:8], p[8:16])
	copy(q[8:16], p[0:8])
	if Sum(q) == base {
		t.Fatal("swap of words 0 and 1 not detected")
	}
	if Sum(append(append([]byte(nil), p...), 0)) == base {
		t.Fatal("appended zero byte not detected")
	}
	if Sum(p[:560]) == base {
		t.Fatal("truncation not detected")
	}
}

func TestPartialRejectsUnalignedOffset(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("Partial at offset 3 did not panic")
		}
	}()
	Partial(make([]byte, 8), 3)
}

func BenchmarkSum(b *testing.B) {
	for _, n := range []int{561, 65536, 1 << 20} {
		p := VectorInput(n)
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				Sum(p)
			}
		})
	}
}
