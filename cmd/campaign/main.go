// Command campaign runs a seeded fault campaign against a real kvtier
// cluster on this machine and prints its report (package campaign).
//
//	go run ./cmd/campaign --seed 7 --faults 10000 --rate 11 --out report.json
//
// It exits 1 when the checker found a problem, 2 when the campaign could
// not run.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/campaign"
)

func main() {
	cfg := campaign.DefaultConfig()
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the fault schedule and the workload (a failing seed replays the same schedule)")
	flag.IntVar(&cfg.Faults, "faults", cfg.Faults, "faults to inject")
	flag.Float64Var(&cfg.Rate, "rate", cfg.Rate, "faults per second")
	flag.IntVar(&cfg.Coordinators, "coordinators", cfg.Coordinators, "1, or 3 replicated through raft (the leader among the kill -9 / SIGSTOP targets)")
	flag.StringVar(&cfg.SourceDir, "src", cfg.SourceDir, "repository root the daemons are built from")
	flag.StringVar(&cfg.BinDir, "bin", "", "directory of prebuilt coordinator and rankd binaries (default: build them)")
	flag.StringVar(&cfg.WorkDir, "dir", "", "work directory (default: a temporary one, removed unless --keep)")
	flag.BoolVar(&cfg.Keep, "keep", false, "keep the work directory (logs, faults.jsonl)")
	flag.StringVar(&cfg.TracePath, "trace", "", "Mooncake trace (default $KVTIER_TRACE, else shared/data/traces/... beside the nearest parent of --src)")
	flag.BoolVar(&cfg.Netns, "netns", cfg.Netns, "one network namespace per rankd when root")
	flag.BoolVar(&cfg.L3, "l3", cfg.L3, "an L3 tier on an S3 server (gofakes3) in the campaign's process, with L3 object faults")
	flag.Int64Var(&cfg.L2Bytes, "l2-bytes", cfg.L2Bytes, "size of the L2 tmpfs in bytes (root)")
	flag.StringVar(&cfg.L1, "l1-bytes", cfg.L1, "each rankd's L1")
	flag.IntVar(&cfg.MaxChunks, "max-chunks", cfg.MaxChunks, "chunks per replayed prompt at most")
	flag.IntVar(&cfg.FinalRuns, "final-runs", cfg.FinalRuns, "engine runs after every fault healed")
	flag.DurationVar(&cfg.Quiesce, "quiesce", cfg.Quiesce, "wait for the index to equal every inventory after the faults")
	out := flag.String("out", "", "write the report as JSON here")
	verbose := flag.Bool("v", false, "log every fault")
	flag.Parse()

	zc := zap.NewProductionConfig()
	if *verbose {
		zc.Level = zap.NewAtomicLevelAt(zap.DebugLevel)
	}
	log, err := zc.Build()
	if err != nil {
		fmt.Fprintln(os.Stderr, "campaign:", err)
		os.Exit(2)
	}
	cfg.Log, cfg.Out = log, os.Stdout
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := campaign.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "campaign:", err)
		os.Exit(2)
	}
	if *out != "" {
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(*out, append(b, '\n'), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "campaign:", err)
			os.Exit(2)
		}
	}
	if !rep.OK {
		os.Exit(1)
	}
}
