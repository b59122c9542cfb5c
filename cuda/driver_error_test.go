package cuda

import (
	"errors"
	"fmt"
	"testing"
)

// batchRefusal tells the driver refusing cuMemcpyBatchAsync (the DMA path
// falls back to a call per copy) from a failure a call per copy would meet
// too (the transfer fails, batching stays on).
func TestBatchRefusal(t *testing.T) {
	de := func(code int) error { return &DriverError{Op: "cuMemcpyBatchAsync", Code: code} }
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{de(1), true}, {de(800), true}, {de(801), true},
		{fmt.Errorf("wrapped: %w", de(801)), true},
		{de(2), false},   // out of memory
		{de(700), false}, // illegal address: the context is gone
		{de(999), false},
		{errors.New("not the driver's"), false},
	} {
		if got := batchRefusal(tc.err); got != tc.want {
			t.Errorf("batchRefusal(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
