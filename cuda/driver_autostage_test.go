//go:build cgo && linux

package cuda

import "testing"

// TestAutoStagedRule: modeAuto stages a scatter whose objects make runs of
// 64 KiB in the host buffer (restores of 16-token chunks, an object per
// 1 MiB L1 slab) and keeps a gather of the same objects direct; both
// stage runs of 512 KiB, neither a transfer under 8 MiB; a forced mode
// wins. Pure policy: no driver is needed.
func TestAutoStagedRule(t *testing.T) {
	objs := func(n int, size, step uint64) []xferObject {
		o := make([]xferObject, n)
		for i := range o {
			o[i] = xferObject{hostOff: uint64(i) * step, len: size}
		}
		return o
	}
	slabs := objs(1024, 64<<10, 1<<20)   // 64 MiB, a run per object
	packed := objs(1024, 64<<10, 64<<10) // the same back to back: one run
	small := objs(16, 64<<10, 1<<20)     // 1 MiB in all
	half := objs(1024, 32<<10, 1<<20)    // runs of 32 KiB
	d := &driverDevice{mode: modeAuto}
	for _, c := range []struct {
		name    string
		objs    []xferObject
		scatter bool
		want    bool
	}{
		{"scatter of 64 KiB runs", slabs, true, true},
		{"gather of 64 KiB runs", slabs, false, false},
		{"scatter of one run", packed, true, true},
		{"gather of one run", packed, false, true},
		{"scatter under 8 MiB", small, true, false},
		{"scatter of 32 KiB runs", half, true, false},
	} {
		if got := d.staged(c.objs, c.scatter); got != c.want {
			t.Errorf("%s: staged %v, want %v", c.name, got, c.want)
		}
	}
	d.mode = modeDirect
	if d.staged(slabs, true) {
		t.Error("modeDirect: staged")
	}
	d.mode = modeStaged
	if !d.staged(small, false) {
		t.Error("modeStaged: not staged")
	}
}
