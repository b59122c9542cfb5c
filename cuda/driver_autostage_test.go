//go:build cgo && linux

package cuda

import "testing"

// TestAutoStagedRule: modeAuto stages a transfer whose objects make runs
// of 512 KiB or more in the host buffer, of 8 MiB or more in all, and
// keeps the others direct, scatters and gathers alike: restores of 64 KiB
// objects, one per L1 slab, stay direct (one rankd per GPU restored them
// 15 % slower staged, stop 64); a forced mode wins. Pure policy: no
// driver is needed.
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
	small := objs(16, 512<<10, 1<<20)    // 8 MiB of 512 KiB runs
	under := objs(15, 512<<10, 1<<20)    // 7.5 MiB of 512 KiB runs
	near := objs(1024, 256<<10, 1<<20)   // runs of 256 KiB
	d := &driverDevice{mode: modeAuto}
	for _, c := range []struct {
		name string
		objs []xferObject
		want bool
	}{
		{"64 KiB runs", slabs, false},
		{"one run", packed, true},
		{"8 MiB of 512 KiB runs", small, true},
		{"7.5 MiB of 512 KiB runs", under, false},
		{"256 KiB runs", near, false},
	} {
		if got := d.staged(c.objs); got != c.want {
			t.Errorf("%s: staged %v, want %v", c.name, got, c.want)
		}
	}
	d.mode = modeDirect
	if d.staged(packed) {
		t.Error("modeDirect: staged")
	}
	d.mode = modeStaged
	if !d.staged(slabs) {
		t.Error("modeStaged: not staged")
	}
}
