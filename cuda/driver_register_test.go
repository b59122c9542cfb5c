//go:build cgo && linux

package cuda

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestDriverRegisterHost (host-shared L1 on a GPU; skipped without a
// driver, so it runs on the H200 only): a tmpfs file mapped twice, as the
// holder's L1 (read-write, registered) and as a peer's view (read-only,
// registered with the read-only flag). A gather into the holder's mapping
// is visible through the peer's; a scatter from the peer's mapping places
// exactly those bytes, with the checksum the gather computed.
func TestDriverRegisterHost(t *testing.T) {
	d := openDriverT(t)
	const size = 1 << 20
	dir := t.TempDir()
	if _, err := os.Stat("/dev/shm"); err == nil {
		if dd, err := os.MkdirTemp("/dev/shm", "kvtier-reg-"); err == nil {
			dir = dd
			t.Cleanup(func() { os.RemoveAll(dd) })
		}
	}
	f, err := os.OpenFile(filepath.Join(dir, "seg"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rw, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(rw)
	ro, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(ro)
	own, err := d.RegisterHost(rw, false)
	if err != nil {
		t.Fatalf("register the holder's mapping: %v", err)
	}
	defer own.Release()
	peer, err := d.RegisterHost(ro, true)
	if err != nil {
		t.Fatalf("register a read-only peer mapping (CU_MEMHOSTREGISTER_READ_ONLY): %v", err)
	}
	defer peer.Release()

	const n = 300000 // odd length: the byte path at the end
	src, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Release()
	dst, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*131 + 7)
	}
	if err := d.Write(src, 0, want); err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	op, err := s.Gather(own, []Object{{HostOff: 4096, Spans: []Span{{Mem: src, Len: n}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ro[4096:4096+n], want) {
		t.Fatal("the gather into the holder's mapping is not what the peer's mapping shows")
	}
	op2, err := s.Scatter(peer, []Object{{HostOff: 4096, Spans: []Span{{Mem: dst, Len: n}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := op2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := d.Read(dst, 0, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) || op2.Sums()[0] != op.Sums()[0] {
		t.Fatalf("scatter from the read-only peer mapping: bytes equal %t, sums %x / %x", bytes.Equal(got, want), op2.Sums()[0], op.Sums()[0])
	}
}
