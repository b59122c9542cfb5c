//go:build cgo && linux

package cuda

import (
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvtier/kvtier/cuda/kernels"
)

// TestKernelSetLoadsEveryHandle: loadKernels fills every handle of
// kernelSet, each from an entry point the committed PTX defines. Stop 50's
// first GPU run of kv_sum_units failed with CUDA_ERROR_INVALID_HANDLE: a
// handle left zero (then by openDriver's copy, now one whole kernelSet).
// Runs without a GPU. Red with an entry left out of entries, or named
// after no .entry of the PTX.
func TestKernelSetLoadsEveryHandle(t *testing.T) {
	var k kernelSet
	typ := reflect.TypeOf(k)
	base := uintptr(unsafe.Pointer(&k))
	seen := map[uintptr]string{}
	for _, e := range k.entries() {
		off := uintptr(unsafe.Pointer(e.fn)) - base
		if prev, ok := seen[off]; ok {
			t.Fatalf("%s and %s fill the same handle", prev, e.name)
		}
		seen[off] = e.name
		if !strings.Contains(kernels.KVCopyPTX, ".entry "+e.name+"(") {
			t.Errorf("%s: no such .entry in the committed PTX", e.name)
		}
	}
	for i := range typ.NumField() {
		f := typ.Field(i)
		if _, ok := seen[f.Offset]; !ok {
			t.Errorf("kernelSet.%s is loaded by no entry: it would stay a zero handle", f.Name)
		}
	}
}
