package cuda

import (
	"context"
	"fmt"
)

// PlainCopy copies the first n bytes of m to the first n bytes of hb
// (toDevice false: device to host) or back (toDevice true) as one
// contiguous copy, and returns once the copy has completed. It is the
// ceiling a transfer is measured against: on the CUDA backend one
// copy-engine copy (cuMemcpyDtoHAsync / cuMemcpyHtoDAsync) on s, on the
// host backend one memmove on the calling goroutine after s's earlier
// work. No checksum, no tables, no kernel. It is a measurement helper, not
// a data path.
func PlainCopy(ctx context.Context, s Stream, m Mem, hb HostBuf, n uint64, toDevice bool) error {
	pc, ok := s.(plainCopier)
	if !ok {
		return fmt.Errorf("%w: PlainCopy on a %T stream", ErrBadHandle, s)
	}
	if m == nil || n > m.Size() {
		return fmt.Errorf("%w: PlainCopy of %d B from a Mem of %d B", ErrOutOfRange, n, memSize(m))
	}
	return pc.plainCopy(ctx, m, hb, n, toDevice)
}

func memSize(m Mem) uint64 {
	if m == nil {
		return 0
	}
	return m.Size()
}

// plainCopier is a stream that can do PlainCopy.
type plainCopier interface {
	plainCopy(ctx context.Context, m Mem, hb HostBuf, n uint64, toDevice bool) error
}

func (s *hostStream) plainCopy(ctx context.Context, m Mem, hb HostBuf, n uint64, toDevice bool) error {
	hm, err := asHostMem(m, "PlainCopy")
	if err != nil {
		return err
	}
	b, err := hostBytes(hb)
	if err != nil {
		return fmt.Errorf("PlainCopy: %w", err)
	}
	if n > uint64(len(b)) {
		return fmt.Errorf("%w: PlainCopy of %d B into a host buffer of %d B", ErrOutOfRange, n, len(b))
	}
	if err := s.Synchronize(ctx); err != nil {
		return err
	}
	if err := hm.acquire(); err != nil {
		return fmt.Errorf("PlainCopy: %w", err)
	}
	defer hm.unref()
	if toDevice {
		copy(hm.data[:n], b[:n])
	} else {
		copy(b[:n], hm.data[:n])
	}
	return nil
}
