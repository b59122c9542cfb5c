//go:build cgo && linux

package cuda

import (
	"testing"
	"unsafe"
)

// The batched DMA path's queue: a contiguous run is one copy, a 2D run one
// copy per row (row k at dev + k*pitch on the device, host + k*width in
// the buffer), destination and source swapped by direction. No GPU needed.
func TestBatchQueueRows(t *testing.T) {
	backing := make([]byte, 4096)
	buf := &driverHostBuf{host: unsafe.Pointer(&backing[0])}
	base := uint64(uintptr(buf.host))
	for _, toDevice := range []bool{true, false} {
		q := &batchQueue{}
		q.add(dmaCopy{dev: 1 << 40, pitch: 512, host: 64, width: 512, rows: 1}, buf, toDevice)
		q.add(dmaCopy{dev: 2 << 40, pitch: 0x300, host: 0x400, width: 0x100, rows: 3}, buf, toDevice)
		type cp struct{ dev, host, n uint64 }
		want := []cp{{1 << 40, base + 64, 512}, {2 << 40, base + 0x400, 0x100},
			{2<<40 + 0x300, base + 0x500, 0x100}, {2<<40 + 0x600, base + 0x600, 0x100}}
		if len(q.sizes) != len(want) || len(q.dsts) != len(want) || len(q.srcs) != len(want) {
			t.Fatalf("to device %v: %d/%d/%d entries, want %d", toDevice, len(q.dsts), len(q.srcs), len(q.sizes), len(want))
		}
		for i, w := range want {
			dst, src := uint64(q.dsts[i]), uint64(q.srcs[i])
			dev, host := dst, src
			if !toDevice {
				dev, host = src, dst
			}
			if dev != w.dev || host != w.host || uint64(q.sizes[i]) != w.n {
				t.Errorf("to device %v, copy %d: device %#x host +%#x %d B, want device %#x host +%#x %d B",
					toDevice, i, dev, host-base, uint64(q.sizes[i]), w.dev, w.host-base, w.n)
			}
		}
	}
}
