package cuda

import (
	"fmt"
	"unsafe"
)

// registerAlign is the alignment and length granule RegisterHost requires:
// a page, so that a registration covers whole pages and a kernel's 16-byte
// access at the end of the buffer stays inside it.
const registerAlign = 4096

// checkRegisterable checks RegisterHost's rules on b.
func checkRegisterable(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("%w: RegisterHost of 0 B", ErrOutOfRange)
	}
	if p := uintptr(unsafe.Pointer(&b[0])); p%registerAlign != 0 || len(b)%registerAlign != 0 {
		return fmt.Errorf("%w: RegisterHost of %d B at %#x: start and length must be multiples of %d B", ErrOutOfRange, len(b), p, registerAlign)
	}
	return nil
}

// RegisterHost wraps b as a host buffer: on the host backend the memory is
// used as it is (no pinning exists to do). Release forgets it; b stays the
// caller's.
func (d *hostDevice) RegisterHost(b []byte, readOnly bool) (HostBuf, error) {
	if err := checkRegisterable(b); err != nil {
		return nil, err
	}
	hb := &hostBuf{dev: d, b: b}
	if err := d.res.add(hb); err != nil {
		return nil, err
	}
	return hb, nil
}
