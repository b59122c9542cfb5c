package cudatest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// testPlainCopy: PlainCopy moves exactly the first n bytes each way, leaves
// the rest of both sides alone, and refuses a copy longer than the Mem.
func testPlainCopy(t *testing.T, dev cuda.Device) {
	ctx := testCtx(t)
	const size, n = 1 << 20, 1<<20 - 4099
	m, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	hb, err := dev.AllocHost(size)
	if err != nil {
		t.Fatal(err)
	}
	defer hb.Release()
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	devImg := pattern(size, 7)
	if err := dev.Write(m, 0, devImg); err != nil {
		t.Fatal(err)
	}
	hostImg := pattern(size, 8)
	copy(hb.Bytes(), hostImg)

	// Device to host: the host buffer's first n bytes become the device's.
	if err := cuda.PlainCopy(ctx, s, m, hb, n, false); err != nil {
		t.Fatalf("PlainCopy device->host: %v", err)
	}
	want := append(append([]byte(nil), devImg[:n]...), hostImg[n:]...)
	if got := hb.Bytes(); !bytes.Equal(got, want) {
		t.Fatalf("host buffer after PlainCopy device->host: first difference at byte %d", firstDiff(got, want))
	}

	// Host to device: the device's first n bytes become the host's.
	hostImg2 := pattern(size, 9)
	copy(hb.Bytes(), hostImg2)
	if err := cuda.PlainCopy(ctx, s, m, hb, n, true); err != nil {
		t.Fatalf("PlainCopy host->device: %v", err)
	}
	got := make([]byte, size)
	if err := dev.Read(m, 0, got); err != nil {
		t.Fatal(err)
	}
	want = append(append([]byte(nil), hostImg2[:n]...), devImg[n:]...)
	if !bytes.Equal(got, want) {
		t.Fatalf("device memory after PlainCopy host->device: first difference at byte %d", firstDiff(got, want))
	}

	if err := cuda.PlainCopy(ctx, s, m, hb, size+1, false); !errors.Is(err, cuda.ErrOutOfRange) {
		t.Fatalf("PlainCopy of %d B from a Mem of %d B: %v, want ErrOutOfRange", size+1, size, err)
	}
}

// pattern is size deterministic bytes that differ between seeds.
func pattern(size int, seed byte) []byte {
	b := make([]byte, size)
	for i := range b {
		b[i] = byte(i*131+i>>11) ^ seed*37
	}
	return b
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
