package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/rankd"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

const exampleConf = "../../deploy/examples/rankd.conf"

// buildRankd builds this command (main cannot be called in-process: it
// parses the process's flags and exits).
func buildRankd(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "rankd")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// runRankd runs bin with args and returns its exit code and stderr.
func runRankd(t *testing.T, bin string, args ...string) (int, string) {
	t.Helper()
	var stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stderr = &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, stderr.String()
	case errors.As(err, &ee):
		return ee.ExitCode(), stderr.String()
	}
	t.Fatalf("run %s: %v", bin, err)
	return 0, ""
}

// TestExampleConfig: the example config parses with rankd's real flags and
// its values pass the checks main makes after parsing (--l1-bytes,
// --l2-policy, --join, --bind): the only error is the command line's
// --log-level, which overrides the file's and is checked after them.
// A typo in a key is refused naming the file, line and key.
func TestExampleConfig(t *testing.T) {
	bin := buildRankd(t)

	rc, stderr := runRankd(t, bin, "--config", exampleConf, "--log-level", "bogus")
	if want := "rankd: --log-level: unrecognized level: \"bogus\"\n"; rc != 2 || stderr != want {
		t.Fatalf("rc %d, stderr %q, want 2 and %q", rc, stderr, want)
	}
	rc, stderr = runRankd(t, bin, "--config", exampleConf, "-h")
	if rc != 0 || !bytes.Contains([]byte(stderr), []byte("-config ")) {
		t.Fatalf("-h: rc %d, stderr %q", rc, stderr)
	}

	data, err := os.ReadFile(exampleConf)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(data, []byte("l2-policy ="))
	if i < 0 {
		t.Fatal("no l2-policy in the example")
	}
	line := bytes.Count(data[:i], []byte("\n")) + 1
	p := filepath.Join(t.TempDir(), "rankd.conf")
	if err := os.WriteFile(p, bytes.Replace(data, []byte("l2-policy ="), []byte("l2_policy ="), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	rc, stderr = runRankd(t, bin, "--config", p)
	if want := fmt.Sprintf("config %s:%d: key \"l2_policy\" is not a flag of rankd: flagfile: unknown key\n", p, line); rc != 2 || stderr != want {
		t.Fatalf("rc %d, stderr %q, want 2 and %q", rc, stderr, want)
	}
}

// TestFlagsDeriveFromRank: the node name and gossip port DefaultConfig
// derives from a rank are derived from the rank the flags name; --bind
// without a port keeps the derived port, with one replaces it.
func TestFlagsDeriveFromRank(t *testing.T) {
	for _, tc := range []struct {
		bind     string
		wantAddr string
		wantPort int
	}{
		{"", "0.0.0.0", 7949},
		{"127.0.0.1", "127.0.0.1", 7949},
		{"127.0.0.1:0", "127.0.0.1", 0},
	} {
		args := []string{"--instance", "e0", "--tp-rank", "2", "--tp-size", "4", "--insecure", "--join", "127.0.0.1:7946"}
		if tc.bind != "" {
			args = append(args, "--bind", tc.bind)
		}
		cfg, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), args)
		if err != nil {
			t.Fatalf("--bind %q: %v", tc.bind, err)
		}
		if cfg.NodeName != "rankd-e0-2" || cfg.BindAddr != tc.wantAddr || cfg.BindPort != tc.wantPort {
			t.Fatalf("--bind %q: node %q, bind %s:%d; want rankd-e0-2, %s:%d", tc.bind, cfg.NodeName, cfg.BindAddr, cfg.BindPort, tc.wantAddr, tc.wantPort)
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("--bind %q: %v", tc.bind, err)
		}
	}
}

// TestCopyFlags: without the copy flags the config holds DefaultConfig's
// DMA tuning and retrieve batch; the flags set them, and a checksum batch
// or retrieve batch of 0 is refused by Validate, naming it.
func TestCopyFlags(t *testing.T) {
	base := []string{"--instance", "e0", "--insecure", "--join", "127.0.0.1:7946"}
	parse := func(extra ...string) rankd.Config {
		t.Helper()
		cfg, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), append(slices.Clone(base), extra...))
		if err != nil {
			t.Fatalf("%q: %v", extra, err)
		}
		return cfg
	}
	def := rankd.DefaultConfig(wire.Rank{Instance: "e0"})
	if cfg := parse(); cfg.DMA != def.DMA || cfg.RetrieveBatchBytes != def.RetrieveBatchBytes || cfg.RestorePace != 0 || def.RestorePace != 0 ||
		cfg.RestorePaceWindow != def.RestorePaceWindow || def.RestorePaceWindow != transfer.DefaultConfig().RetrievePaceWindow ||
		cfg.RetrieveRamp != def.RetrieveRamp || def.RetrieveRamp != transfer.DefaultConfig().RetrieveRamp ||
		cfg.RetrieveTailRamp != def.RetrieveTailRamp || def.RetrieveTailRamp != transfer.DefaultConfig().RetrieveTailRamp ||
		cfg.Streams != def.Streams || def.Streams != transfer.DefaultConfig().Streams {
		t.Fatalf("defaults: DMA %+v, retrieve batch %d, pace %d, window %v; DefaultConfig has %+v, %d, %d, %v", cfg.DMA, cfg.RetrieveBatchBytes, cfg.RestorePace, cfg.RestorePaceWindow, def.DMA, def.RetrieveBatchBytes, def.RestorePace, def.RestorePaceWindow)
	}
	cfg := parse("--dma-sum-batch", "64MiB", "--dma-queue", "32MiB", "--dma-unit-sums", "--dma-sum-blocks", "16", "--dma-sm-control", "--dma-sm-control-duplex", "--dma-sm-sums-scatter", "--retrieve-batch-bytes", "512MiB", "--restore-pace-gbps", "20", "--restore-pace-window", "16ms", "--retrieve-ramp", "0", "--retrieve-tail-ramp", "2", "--streams", "4")
	if cfg.DMA != (cuda.DMATuning{SumBatch: 64 << 20, Queue: 32 << 20, UnitSums: true, SumBlocks: 16, SMControl: true, SMControlDuplex: true, SMSumsScatter: true}) || cfg.RetrieveBatchBytes != 512<<20 || cfg.RestorePace != 20e9 || cfg.RestorePaceWindow != 16*time.Millisecond || cfg.RetrieveRamp != 0 || cfg.RetrieveTailRamp != 2 || cfg.Streams != 4 {
		t.Fatalf("flags: DMA %+v, retrieve batch %d, pace %d, window %v, ramp %d, tail ramp %d", cfg.DMA, cfg.RetrieveBatchBytes, cfg.RestorePace, cfg.RestorePaceWindow, cfg.RetrieveRamp, cfg.RetrieveTailRamp)
	}
	// the restore's sums by kv_move: on by default since stop 62, =false turns it off
	if !def.DMA.SMSumsScatter || parse("--dma-sm-sums-scatter=false").DMA.SMSumsScatter {
		t.Errorf("--dma-sm-sums-scatter: default %v, want on; =false must turn it off", def.DMA.SMSumsScatter)
	}
	// --l1-slab-bytes: auto (0, SlabFor at start) unless given; a size
	// that is no multiple of 4096 B, larger than L1, or making more than
	// 2^24 slabs is refused naming the slab; 0 is refused at parsing.
	if def.L1SlabBytes != 0 || parse().L1SlabBytes != 0 || parse("--l1-slab-bytes", "auto").L1SlabBytes != 0 {
		t.Errorf("--l1-slab-bytes: default %d, want 0 (auto)", def.L1SlabBytes)
	}
	if cfg := parse("--l1-slab-bytes", "64KiB"); cfg.L1SlabBytes != 64<<10 || cfg.Validate() != nil {
		t.Errorf("--l1-slab-bytes 64KiB: %d B, Validate %v", cfg.L1SlabBytes, cfg.Validate())
	}
	for _, bad := range [][]string{{"--l1-slab-bytes", "6000"}, {"--l1-slab-bytes", "2GiB"}, {"--l1-bytes", "128GiB", "--l1-slab-bytes", "4KiB"}} {
		cfg := parse(bad...)
		if err := cfg.Validate(); !errors.Is(err, rankd.ErrConfig) || !strings.Contains(err.Error(), "slab") {
			t.Errorf("%q: Validate = %v, want ErrConfig naming the slab", bad, err)
		}
	}
	if _, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), append(slices.Clone(base), "--l1-slab-bytes", "0")); err == nil {
		t.Error("--l1-slab-bytes 0 parsed")
	}
	if !def.DMA.SMControlDuplex || parse("--dma-sm-control-duplex=false").DMA.SMControlDuplex {
		t.Errorf("--dma-sm-control-duplex: default %v, =false did not turn it off", def.DMA.SMControlDuplex)
	}
	slow := parse("--restore-pace-gbps", "0.05")
	if err := slow.Validate(); !errors.Is(err, rankd.ErrConfig) || !strings.Contains(err.Error(), "restore pace") {
		t.Errorf("--restore-pace-gbps 0.05: Validate = %v, want ErrConfig naming the restore pace", err)
	}
	if _, _, err := parseFlags(flag.NewFlagSet("rankd", flag.ContinueOnError), append(slices.Clone(base), "--restore-pace-gbps", "-1")); err == nil {
		t.Error("--restore-pace-gbps -1 parsed")
	}
	if cfg := parse("--dma-sum-blocks", "65537"); !errors.Is(cfg.Validate(), rankd.ErrConfig) || !strings.Contains(fmt.Sprint(cfg.Validate()), "65536") {
		t.Errorf("--dma-sum-blocks 65537: Validate = %v, want ErrConfig naming the bound", cfg.Validate())
	}
	for _, tc := range []struct{ flag, want string }{{"--dma-sum-batch", "checksum batch of 0"}, {"--retrieve-batch-bytes", "retrieve batch of 0"}, {"--restore-pace-window", "pace window"}, {"--retrieve-ramp", "ramp"}, {"--retrieve-tail-ramp", "tail ramp"}, {"--streams", "streams"}} {
		v := "0"
		if strings.HasSuffix(tc.flag, "ramp") {
			v = "9"
		}
		cfg := parse(tc.flag, v)
		if err := cfg.Validate(); !errors.Is(err, rankd.ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: Validate = %v, want ErrConfig naming %q", tc.flag, v, err, tc.want)
		}
	}
}
