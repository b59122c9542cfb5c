package cuda_test

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"

	"github.com/kvtier/kvtier/cuda"
)

// TestRegisterHost: memory the caller mapped becomes a host buffer whose
// bytes are that memory (a scatter from it places exactly them), start and
// length must be page multiples, and Release leaves the mapping alone; on
// both copy paths.
func TestRegisterHost(t *testing.T) {
	for _, path := range []string{cuda.PathSM, cuda.PathDMA} {
		t.Run(path, func(t *testing.T) { testRegisterHost(t, path) })
	}
}

func testRegisterHost(t *testing.T, path string) {
	dev := openHost(t)
	cuda.SetCopyPath(dev, path)
	m, err := syscall.Mmap(-1, 0, 3*4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(m)
	for i := range m {
		m[i] = byte(i*7 + 3)
	}
	for _, bad := range [][]byte{m[:100], m[8 : 8+4096], m[:0]} {
		if _, err := dev.RegisterHost(bad, false); !errors.Is(err, cuda.ErrOutOfRange) {
			t.Fatalf("RegisterHost of %d B: %v, want ErrOutOfRange", len(bad), err)
		}
	}
	hb, err := dev.RegisterHost(m[4096:], true)
	if err != nil {
		t.Fatal(err)
	}
	if &hb.Bytes()[0] != &m[4096] {
		t.Fatal("the buffer is not the registered memory")
	}
	dst, err := dev.Alloc(1000)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	op, err := s.Scatter(hb, []cuda.Object{{HostOff: 4096 + 5, Spans: []cuda.Span{{Mem: dst, Off: 0, Len: 1000}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if op.Path() != path {
		t.Fatalf("copy path %q, want %q", op.Path(), path)
	}
	got := make([]byte, 1000)
	if err := dev.Read(dst, 0, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, m[2*4096+5:2*4096+1005]) {
		t.Fatal("scatter from the registered memory placed other bytes")
	}
	if err := hb.Release(); err != nil {
		t.Fatal(err)
	}
	m[0] = 1 // still mapped
}
