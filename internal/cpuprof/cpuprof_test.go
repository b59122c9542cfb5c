package cpuprof

import (
	"os"
	"path/filepath"
	"testing"
)

func TestStartWritesProfile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "cpu.pprof")
	stop, err := Start(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() == 0 {
		t.Fatalf("%s is empty, want a profile", p)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s has mode %v, want 0600", p, fi.Mode().Perm())
	}
}

func TestStartNoneAndBadPath(t *testing.T) {
	stop, err := Start("")
	if err != nil || stop() != nil {
		t.Fatalf("Start(\"\"): %v", err)
	}
	if _, err := Start(filepath.Join(t.TempDir(), "missing", "cpu.pprof")); err == nil {
		t.Fatal("Start into a missing directory succeeded")
	}
}
