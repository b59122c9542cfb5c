package wire

import (
	"errors"
	"testing"
	"time"
)

// TestHeaderValues: the deadline and pace headers parse what the engines
// send and refuse anything else as malformed.
func TestHeaderValues(t *testing.T) {
	at := time.Unix(0, 1796485189806517600)
	if got, err := ParseDeadline(FormatDeadline(at)); err != nil || !got.Equal(at) {
		t.Fatalf("deadline round trip: %v, %v", got, err)
	}
	for _, bad := range []string{"", "0", "-5", "soon", "1.5"} {
		if _, err := ParseDeadline(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("deadline %q: %v, want ErrMalformed", bad, err)
		}
	}
	for v, want := range map[string]uint64{"0": 0, "104857600": 100 << 20, "20000000000": 20e9} {
		if got, err := ParsePace(v); err != nil || got != want {
			t.Errorf("pace %q: %d, %v; want %d", v, got, err, want)
		}
	}
	for _, bad := range []string{"", "-1", "fast", "2e10", "1.5", "18446744073709551616"} {
		if _, err := ParsePace(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("pace %q: %v, want ErrMalformed", bad, err)
		}
	}
}
