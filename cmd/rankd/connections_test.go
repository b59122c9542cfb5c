package main

import (
	"os"
	"testing"
)

// TestCUDAConnections: rankd runs with the driver's most hardware work
// queues unless its environment names a number, which it keeps (an empty
// value names none).
func TestCUDAConnections(t *testing.T) {
	const env = "CUDA_DEVICE_MAX_CONNECTIONS"
	t.Setenv(env, "")
	if err := os.Unsetenv(env); err != nil {
		t.Fatal(err)
	}
	if got := cudaConnections(); got != maxConnections || os.Getenv(env) != maxConnections {
		t.Fatalf("unset: in effect %q, environment %q, want %s", got, os.Getenv(env), maxConnections)
	}
	t.Setenv(env, "")
	if got := cudaConnections(); got != maxConnections || os.Getenv(env) != maxConnections {
		t.Fatalf("empty: in effect %q, environment %q, want %s", got, os.Getenv(env), maxConnections)
	}
	t.Setenv(env, "8")
	if got := cudaConnections(); got != "8" || os.Getenv(env) != "8" {
		t.Fatalf("set to 8: in effect %q, environment %q, want 8 kept", got, os.Getenv(env))
	}
}
