// Command enginesim plays the workers and scheduler of a TP x DCP inference
// engine against a kvtier cluster: it stores a prompt's KV in many
// incremental stores, wipes the pages, restores them through the
// coordinator's restore protocol and compares every byte on every rank.
// It exits non-zero on any mismatch or unexpected verdict.
//
//	enginesim --scenario tp4dcp4 --nats nats://127.0.0.1:4222 --creds-dir D --device host
//	enginesim --spec my-model.json ...   # a model spec file (docs/enginesim.md)
//	enginesim --spec tp8dcp2 ...         # a spec shipped in enginesim/specs/
//
// With --bench it times a store and a restore of the whole prompt through
// the rankds, repeated, against a plain copy of the same bytes
// (scripts/gpu-bench.sh starts the daemons and runs it).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/kvtier/kvtier/enginesim"
)

func main() {
	cfg := enginesim.DefaultConfig()
	cfg.NATSURL = "nats://127.0.0.1:4222"
	var devices, hostDir string
	flag.StringVar(&cfg.Scenario, "scenario", cfg.Scenario, "built-in scenario: "+strings.Join(enginesim.ScenarioNames(), ", ")+" (each also ships as a spec file)")
	flag.StringVar(&cfg.SpecFile, "spec", "", "model spec FILE (JSON, or YAML by a .yaml/.yml name; format in docs/enginesim.md) replacing --scenario, "+
		"or the name of a spec shipped in "+enginesim.SpecDir+"/ (built into this binary): "+strings.Join(enginesim.ShippedSpecs(), ", "))
	listSpecs := flag.Bool("list-specs", false, "list the shipped specs ("+enginesim.SpecDir+"/) with their descriptions and exit")
	flag.StringVar(&cfg.Instance, "instance", cfg.Instance, "engine instance the rankds serve")
	flag.StringVar(&devices, "device", strings.Join(cfg.Devices, ","), "device spec for every rank, or a comma-separated one per rank (host, auto, cuda:N, GPU UUID)")
	flag.StringVar(&hostDir, "host-dir", "", "host backend shared-memory directory (private 0700 dir, must match the rankds'; default /dev/shm/kvtier-<uid>)")
	flag.StringVar(&cfg.NATSURL, "nats", cfg.NATSURL, "NATS URL(s) of the coordinator, comma-separated for a NATS cluster")
	flag.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "NATS subject prefix")
	flag.StringVar(&cfg.Creds.Dir, "creds-dir", "", "credentials directory from 'coordinator init' (engine-<instance>.nk; required unless --insecure)")
	flag.StringVar(&cfg.Creds.SeedFile, "creds", "", "the engine identity's nkey seed file (default <creds-dir>/engine-<instance>.nk)")
	flag.StringVar(&cfg.Creds.CAFile, "tls-ca", "", "CA certificate verifying the NATS server (default <creds-dir>/ca.pem if present)")
	flag.BoolVar(&cfg.Creds.Insecure, "insecure", false, "DEVELOPMENT ONLY: connect without credentials")
	flag.StringVar(&cfg.Phase, "phase", cfg.Phase, "store | restore | all")
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "content seed (the same seed regenerates the same prompt and pages)")
	flag.IntVar(&cfg.Chunks, "chunks", 0, "chunks in the prompt (0: the scenario's)")
	flag.BoolVar(&cfg.StateAtEnd, "state-at-end", false, "restore the recurrent groups' pages of the prefix's last chunk only (an engine resuming from the state at the prefix's end); the inner chunks' state pages must stay as the wipe")
	flag.IntVar(&cfg.StateEvery, "state-every", 0, "with --state-at-end: store the recurrent groups' pages of every Nth chunk only (the others without a state); the restore covers the chunks up to the last one with a state")
	flag.BoolVar(&cfg.ExpectFail, "expect-fail", false, "the restore must fail; chunks it does not name must still be byte-exact")
	flag.BoolVar(&cfg.FailOpen, "fail-open", false, "serve as an engine must with the cache down or failing: what kvtier does not confirm is recomputed, not an error (a wrong byte under a COMPLETE verdict still fails)")
	flag.DurationVar(&cfg.AttachWait, "attach-wait", 0, "fail-open: keep trying to reach kvtier and register for this long before serving without it")
	flag.DurationVar(&cfg.Compute, "compute", cfg.Compute, "simulated compute per chunk before its pages are written")
	flag.DurationVar(&cfg.RestoreDeadline, "restore-deadline", cfg.RestoreDeadline, "restore deadline asked of the coordinator")
	flag.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "timeout of each request")
	flag.DurationVar(&cfg.WaitPrefix, "wait-prefix", cfg.WaitPrefix, "before a restore, wait up to this long for the lookup to cover the prompt (0 or negative: no wait)")
	flag.StringVar(&cfg.HoldBeforeRetrieve, "hold-before-retrieve", "", "after the restore plan, wait until this file exists")
	flag.StringVar(&cfg.HoldBeforeStore, "hold-before-store", "", "after registering, wait until this file exists before storing")
	flag.BoolVar(&cfg.KeepRegistered, "keep-registered", false, "do not release the pools at exit")
	flag.StringVar(&cfg.ResultFile, "result", "", "write the result as JSON to this file")
	flag.BoolVar(&cfg.Bench, "bench", false, "daemon-path benchmark: timed store and restore of the prompt, repeated, against a plain copy of the same bytes")
	flag.IntVar(&cfg.BenchReps, "bench-reps", cfg.BenchReps, "bench: repetitions (median, min and max reported)")
	flag.IntVar(&cfg.BenchChunksPerStore, "bench-chunks-per-store", cfg.BenchChunksPerStore, "bench: chunks per store request (8: a chunked prefill of 16,384 tokens per engine step in chunks of 2,048)")
	flag.BoolVar(&cfg.JSONRequests, "json-requests", false, "send store, retrieve and restore.begin requests as JSON (as engines before the binary forms; rankd and coordinator read both)")
	flag.DurationVar(&cfg.BenchTraffic, "bench-traffic", 0, "bench: after the repetitions, restore the last prompt again and again for this long (each verdict must be COMPLETE; bytes not compared): traffic for an interference measurement")
	flag.IntVar(&cfg.BenchDuplex, "bench-duplex", 0, "bench: after the repetitions, this many repetitions of a fresh store and the previous prompt's restore at once (both copy directions), against plain copies both ways; needs disjoint store and restore block tables (a consecutive spec)")
	flag.Float64Var(&cfg.BenchGB, "bench-gb", 0, "bench: size the prompt so the busiest rank stores this many GB (overrides --chunks)")
	flag.Usage = func() {
		out := flag.CommandLine.Output()
		fmt.Fprintf(out, "Usage: enginesim [--scenario NAME | --spec FILE] --nats URL --creds-dir DIR [flags]\n\n"+
			"Stores a prompt's KV through the rankds, wipes it, restores it through the coordinator and compares every byte.\n"+
			"--spec FILE describes any model (groups, page/semantic/stride bytes, TP, DCP, interleave); shipped specs\n"+
			"(the built-in scenarios, every seed geometry row, TP8, DCP2/8, odd rows, block ids near 2^31) are in\n"+
			"%s/ and built in by name (--list-specs). Format: docs/enginesim.md.\n\n", enginesim.SpecDir)
		flag.PrintDefaults()
	}
	flag.Parse()
	if *listSpecs {
		for _, n := range enginesim.ShippedSpecs() {
			sc, err := enginesim.LoadSpec(n)
			if err != nil {
				fmt.Fprintf(os.Stderr, "enginesim: shipped spec %s: %v\n", n, err)
				os.Exit(1)
			}
			fmt.Printf("%-28s %s\n", n, sc.Describe)
		}
		return
	}
	if cfg.SpecFile != "" {
		scenarioSet := false
		flag.Visit(func(f *flag.Flag) { scenarioSet = scenarioSet || f.Name == "scenario" })
		if scenarioSet {
			fmt.Fprintln(os.Stderr, "enginesim: give --scenario or --spec, not both")
			os.Exit(2)
		}
		cfg.Scenario = ""
	}

	if cfg.Creds.Insecure {
		fmt.Fprintln(os.Stderr, "enginesim: INSECURE (--insecure): connecting without credentials; only an --insecure coordinator accepts that")
	}
	cfg.Devices = strings.Split(devices, ",")
	if hostDir != "" {
		cfg.Host.Dir = hostDir
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := enginesim.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "enginesim: FAILED:", err)
		os.Exit(1)
	}
}
