package enginesim

import (
	"strings"
	"testing"
)

// TestConfigZeroMeansZero: Run validates what it is given (STYLE 23): a
// zero Config names everything it lacks instead of running on defaults,
// a zero Timeout or bench repetition count is an error, and DefaultConfig
// with a NATS URL is valid.
func TestConfigZeroMeansZero(t *testing.T) {
	var zero Config
	err := zero.Validate()
	if err == nil {
		t.Fatal("a zero Config validated")
	}
	for _, want := range []string{"no instance", "no device spec", "no NATS URL", "no subject prefix", `phase ""`,
		"restore deadline 0s", "timeout 0s", "no output writer"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("zero Config: error %q does not say %q", err, want)
		}
	}
	if _, err := Run(t.Context(), zero); err == nil {
		t.Fatal("Run accepted a zero Config")
	}
	c := DefaultConfig()
	c.NATSURL = "nats://127.0.0.1:1"
	if err := c.Validate(); err != nil {
		t.Fatalf("DefaultConfig with a NATS URL: %v", err)
	}
	c.Timeout = 0
	c.Bench, c.BenchReps = true, 0
	err = c.Validate()
	if err == nil || !strings.Contains(err.Error(), "timeout 0s") || !strings.Contains(err.Error(), "bench repetitions 0") {
		t.Fatalf("zero timeout and bench repetitions: %v", err)
	}
}
