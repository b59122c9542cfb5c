#!/usr/bin/env bash
# The GPU measurements still pending for issues 24 and 25 (docs/gpu.md), in
# priority order, each bounded so that the whole fits a 10-minute call:
#
#   scripts/gpu-pending.sh cuda CUDA_TEST  issue 25: the driver tests (their whole conformance
#                                          suite outran 150 s at stop 62), both checksum
#                                          kernels' speed, the small-chunk layout's copy modes
#   scripts/gpu-pending.sh daemons BIN     issue 25: no vLLM needed (torch for the loop; step
#                                          hf-r4-16 also nats-py on PYTHONPATH)
#   scripts/gpu-pending.sh vllm BIN        issue 24: vLLM importable (PYTHONPATH)
#   scripts/gpu-pending.sh replay BIN      issue 24: the same, TRACE= the Mooncake trace
#
# BIN holds coordinator, rankd and enginesim (make gpu-build or go build).
# Every result and log goes into one tarball, $OUT/pending-<set>.tar.gz
# (OUT: the device tool's output folder, or ./pending-out), and the
# summary lines to stdout, so a tool that brings back few files or only
# the output's tail loses nothing. BUDGET=seconds (default 560) bounds the
# set; a step that would start with less than its own bound left is
# skipped and said so. STEPS=regex runs only the steps whose names match
# (the rest of a set for a later call). MPS=1 runs the set under a CUDA
# MPS server of its own (docs/gpu.md).
set -uo pipefail

SET=${1:-}
BIN=${2:-}
if [[ -z $SET || -z $BIN ]]; then
	echo "usage: $0 cuda CUDA_TEST | daemons|vllm|replay BIN_DIR" >&2
	exit 2
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
OUT=${OUT:-$PWD/pending-out}
R=$(mktemp -d -t kvtier-pending.XXXXXX)
T0=$(date +%s)
BUDGET=${BUDGET:-560}

left() { echo $((BUDGET - ($(date +%s) - T0))); }
# step NAME BOUND CMD...: runs CMD with its output in $R/NAME.log when BOUND
# seconds are left, and prints the log's summary lines.
step() {
	local name=$1 bound=$2
	shift 2
	[[ $name =~ ^(${STEPS:-.*})$ ]] || return 0
	if (($(left) < bound)); then
		echo "== $name: skipped, $(left) s left of $BUDGET" | tee -a "$R/steps.txt"
		return
	fi
	echo "== $name at $(($(date +%s) - T0)) s" | tee -a "$R/steps.txt"
	timeout "$bound" "$@" >"$R/$name.log" 2>&1
	echo "rc=$?" >>"$R/$name.log"
	grep -E '^(store|restore) \(|store \+ restore|plain copies|interference:|gpu-vllm: kvtier|^\| kvtier|^\| [0-9]|replay: \{|rc=|^--- FAIL|^(FAIL|ok|PASS)$|^\| (block_major|kv_split)|^  (store|restore verdict) \(all ranks\)|^  (stores|restores) 2-|^RESULT|host enqueue by mode' \
		"$R/$name.log" | cut -c1-300
}
finish() {
	mkdir -p "$OUT"
	tar czf "$OUT/pending-$SET.tar.gz" -C "$R" . && echo "results: $OUT/pending-$SET.tar.gz"
}
trap finish EXIT

DEVICE=${DEVICE:-cuda:0}
BIG=${GB_BIG:-1.3} SMALL=${GB_SMALL:-0.5} TINY=${GB_TINY:-0.067} # GB per rank (smaller for a smoke test)
# bench NAME: the gpu-bench.sh command line of a step, after VAR=value words
bench() { echo env DEVICE="$DEVICE" OUT="$R/bench-$1.json" bash scripts/gpu-bench.sh "$BIN"; }

# rankd_args V: the rankd arguments of a variant, words joined by "+"
# (units+ramp0: kv_sum_units and no batch ramp; tail3: the last batches
# an eighth, a quarter, a half of the bound; sb16: the hidden checksums in
# 16 blocks; smc: tables and sums by kv_move, not the copy engine; smcd:
# by kv_move only beside a transfer of the other direction, the default
# since stop 54; nosmcd: never, stop 53's defaults; sms: every restore
# batch's sums by kv_move, the default since stop 62; nosms: without it;
# staged / direct: the copy kernels in one mode)
rankd_args() {
	local v ra=
	for v in ${1//+/ }; do
		case $v in default) ;; units) ra+=" --dma-unit-sums" ;; ramp*) ra+=" --retrieve-ramp ${v#ramp}" ;;
		tail*) ra+=" --retrieve-tail-ramp ${v#tail}" ;; sb*) ra+=" --dma-sum-blocks ${v#sb}" ;;
		smc) ra+=" --dma-sm-control" ;; sms) ra+=" --dma-sm-sums-scatter" ;; nosms) ra+=" --dma-sm-sums-scatter=false" ;;
		staged) ra+=" --copy-path sm-staged" ;; direct) ra+=" --copy-path sm-direct" ;; smcd) ra+=" --dma-sm-control-duplex" ;; nosmcd) ra+=" --dma-sm-control-duplex=false" ;; st*) ra+=" --streams ${v#st}" ;;
		sm) ra+=" --copy-path sm" ;; nohint) ra+=" --dma-no-overlap-hint" ;; each) ra+=" --dma-each-copy" ;;
		pace*w*) v=${v#pace} ra+=" --restore-pace-gbps ${v%w*} --restore-pace-window ${v#*w}ms" ;;
		pace*) ra+=" --restore-pace-gbps ${v#pace}" ;;
		*) echo "gpu-pending: unknown variant $v" >&2; return 1 ;; esac
	done
	echo "${ra# }"
}

# interference V: the decode-shaped loop while rankd (with V's arguments)
# restores the 8B pages at full speed
interference() {
	local ra
	ra=$(rankd_args "$1") || return
	local bound=110 more=()
	# the defaults' run adds the controls: what 1 MiB pieces, one reduction
	# per GiB and reductions alone from another process cost the loop
	[[ $1 == default && ${CONTROLS:-1} == 1 ]] && bound=170 more=(--controls)
	local name=interference-$1${MPS_NAME:-}
	step "$name" $bound python3 python/examples/gpu_interference.py --seconds 8 --warm 3 "${more[@]}" \
		--logs "$R/$name" --traffic-cmd "${TRAFFIC_ENV:-} RANKD_ARGS='$ra' SPEC=enginesim/specs/llama8b-tp1.json \
DEVICE=$DEVICE GB=$BIG REPS=1 TRAFFIC=10m OUT=$R/traffic-$name.json bash scripts/gpu-bench.sh $BIN"
}

# mps_start / mps_stop: a CUDA MPS control daemon of this run's own (in
# $R), so that every CUDA process started meanwhile shares one MPS server:
# kernels of different processes then share the SMs instead of
# time-slicing the GPU between contexts.
mps_start() {
	if ! command -v nvidia-cuda-mps-control >/dev/null; then
		echo "== MPS: no nvidia-cuda-mps-control on this machine" | tee -a "$R/steps.txt"
		return 1
	fi
	export CUDA_MPS_PIPE_DIRECTORY=$R/mps/pipe CUDA_MPS_LOG_DIRECTORY=$R/mps/log
	mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
	if ! nvidia-cuda-mps-control -d; then
		echo "== MPS: the control daemon did not start" | tee -a "$R/steps.txt"
		unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
		return 1
	fi
	echo "== MPS: control daemon started ($CUDA_MPS_PIPE_DIRECTORY)" | tee -a "$R/steps.txt"
}
mps_stop() {
	[[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]] || return 0
	echo quit | nvidia-cuda-mps-control
	sleep 2
	unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# mps_step NAME CMD...: CMD under MPS, in the set's server (MPS=1) or in
# one of the step's own; skipped unless NAME matches STEPS
mps_step() {
	local name=$1 own=0
	shift
	[[ $name =~ ^(${STEPS:-.*})$ ]] || return 0
	if [[ -z ${CUDA_MPS_PIPE_DIRECTORY:-} ]]; then
		mps_start || return 0
		own=1
	fi
	"$@"
	((own)) && mps_stop
	return 0
}

# mps_interference V PCT: the loop beside restores under MPS, the traffic
# command's processes (rankd, enginesim) limited to PCT % of the SMs
mps_interference() {
	MPS_NAME=-mps$2 TRAFFIC_ENV="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$2" mps_step "interference-$1-mps$2" interference "$1"
}

# MPS=1: the whole set under one MPS server (an A/B against a run without)
# Several rankds under one MPS server need fewer hardware queues each than
# rankd's own 32: with 32, four rankds' first context failed at
# cuDevicePrimaryCtxRetain (CUDA_ERROR_OUT_OF_MEMORY, stop 55); with 8 they
# ran (stop 56). RANKD_ENV set by the caller is kept as given.
if [[ ${MPS:-0} == 1 ]]; then
	export RANKD_ENV=${RANKD_ENV-CUDA_DEVICE_MAX_CONNECTIONS=8}
	mps_start || exit 3
	trap 'mps_stop; finish' EXIT
fi

case $SET in
cuda)
	# 25.2/25.5: the driver tests (kv_sum_units' among them: passed on an
	# H100 at stop 51), then its speed against kv_checksum's alone
	T=$(realpath "$BIN")
	step cuda-tests 300 bash -c "cd cuda && '$T' -test.run 'TestDriverUnitSums|TestDriverConformance|TestDriverPaths' -test.v"
	step cuda-sums 40 bash -c "cd cuda && '$T' -test.run '^\$' -test.bench DriverSums -test.benchtime 1x"
	# 25.4: the small-chunk layout (an object per L1 slab) in every copy
	# mode, with each mode's host enqueue (stop 62: direct 0.93 / 0.84 of
	# CE, staged 0.82 / 0.90, gather / scatter)
	step cuda-slab 200 bash -c "cd cuda && KVTIER_BENCH_ONLY=slab KVTIER_BENCH_GB=1 KVTIER_BENCH_REPS=3 '$T' -test.run '^\$' -test.bench DriverTransfer -test.benchtime 1x"
	;;
daemons)
	P=enginesim/specs
	# 24.4/25.5: what the rankd's kernels cost the loop beside full-speed
	# restores goes with their count more than their bytes (stop 52, an
	# H100: the tail ramp's three more checksum kernels 1.217x against
	# 1.172x; kv_move's two small kernels cost vLLM's decoders 1.34x
	# against 1.2x). So: kv_sum_units (1.125x) with two restore batches
	# instead of four (--retrieve-ramp 0), the defaults in the same call
	for v in default units+ramp0 units ramp0; do
		interference "$v"
	done
	# 25.3: both directions (stop 52: 1.03-1.10x with the defaults, 1.05-1.20x
	# with kv_move, the card's plain copies 1.17-1.31x): kv_move with 4 + 4
	# streams (whether the store's stream shares a hardware queue with the
	# restore's: 8 + 8 streams, two CUDA streams each, on 32 queues, plus
	# the timer's), beside the defaults and kv_move alone
	step duplex-dma 110 env DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 $(bench duplex-dma)
	step duplex-smc-st4 110 env DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 RANKD_ARGS="$(rankd_args smc+st4)" $(bench duplex-smc-st4)
	step duplex-smc 110 env DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 RANKD_ARGS="$(rankd_args smc)" $(bench duplex-smc)
	# 25.1: one rankd at 1.3 and 0.5 GB (stop 52, 1.3 GB, five repetitions:
	# restore 0.870 with the defaults, 0.843 with kv_sum_units, 0.861 with
	# the tail ramp), with two batches a restore
	for v in default units+ramp0 ramp0; do
		step "tp1-$v" 80 env SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=5 RANKD_ARGS="$(rankd_args $v)" $(bench "tp1-$v")
	done
	for v in default units+ramp0; do
		step "tp1-small-$v" 60 env SPEC=$P/llama8b-tp1.json GB="$SMALL" REPS=5 RANKD_ARGS="$(rankd_args $v)" $(bench "tp1-small-$v")
	done
	# 25.4: a restore's fixed cost is mostly messages between three
	# processes (stop 54, this VM: ~0.45 ms from the rankd's reply to the
	# engine holding it, ~0.1 ms of it the wire); the same run with every
	# core kept busy by idle-priority loops, so that no core sleeps deeply
	# and a woken thread runs at once: how much of the cost is the host's
	# wake-up latency
	step tp1-small-spin 60 bash -c "for _ in \$(seq \$(nproc)); do nice -n 19 sh -c 'while :; do :; done' & done
		env SPEC=$P/llama8b-tp1.json GB=$SMALL REPS=5 $(bench tp1-small-spin); rc=\$?; kill \$(jobs -p); exit \$rc"
	# extra variants of a call: EXTRA_DUPLEX / EXTRA_TP1 / EXTRA_TP4 / EXTRA_INTERFERENCE="v1 v2" (rankd_args' words)
	for v in ${EXTRA_INTERFERENCE:-}; do
		interference "$v"
	done
	# 25.5: under MPS, the kvtier processes on all SMs or a quarter
	# (MPS_INTERFERENCE: variant:percent words)
	for vp in ${MPS_INTERFERENCE:-default:100 default:25}; do
		mps_interference "${vp%:*}" "${vp#*:}"
	done
	for v in ${EXTRA_DUPLEX:-}; do
		step "duplex-$v" 110 env DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 RANKD_ARGS="$(rankd_args $v)" $(bench "duplex-$v")
	done
	for v in ${EXTRA_TP1:-}; do
		step "tp1-$v" 80 env SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=5 RANKD_ARGS="$(rankd_args $v)" $(bench "tp1-$v")
	done
	for v in ${EXTRA_TP4:-}; do
		step "tp4-big-$v" 150 env SPEC=$P/llama8b-tp4.json GB="$BIG" REPS=2 RANKD_ARGS="$(rankd_args $v)" $(bench "tp4-big-$v")
	done
	# 25.1: 4 rankds sharing the GPU, 0.5 and 1.3 GB per rank (0.920 of CE
	# at 1.3 GB on the H200 at stop 47, one run)
	step tp4-small 80 env SPEC=$P/llama8b-tp4.json GB="$SMALL" REPS=2 $(bench tp4-small)
	step tp4-big 150 env SPEC=$P/llama8b-tp4.json GB="$BIG" REPS=2 $(bench tp4-big)
	for v in pace10 pace20 pace5 pace10w4; do
		interference "$v"
	done
	step duplex-8q 110 env CUDA_DEVICE_MAX_CONNECTIONS=8 DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 $(bench duplex-8q)
	step tp4-16tok 80 env SPEC=$P/llama8b-tp4.json GB="$TINY" REPS=2 PER=128 $(bench tp4-16tok)
	step duplex-sm 110 env DUPLEX=3 SPEC=$P/llama8b-tp1.json GB="$BIG" REPS=1 RANKD_ARGS="--copy-path sm" $(bench duplex-sm)
	interference sm
	# 25.4: 16-token chunks through the Python client, four rankds: the first
	# store against warm ones (--store-reps, stop 63; nats-py on PYTHONPATH;
	# HF_DEVICE=host runs it on the host backend)
	step hf-r4-16 120 python3 python/examples/hf_roundtrip.py --bin "$BIN" --device "${HF_DEVICE:-cuda}" --ranks 4 --kv-heads 8 --layers 8 \
		--generate 1 --chunks 1024 --blocks-per-chunk 1 --store-reps 5 --restore-reps 5 --timeline
	# 25.4: whether the L2 write-behind of the stores before slows the
	# restores (on this 2-core VM, one rankd: 0.059 of memmove without L2
	# against 0.013 with it, stop 64; not measured on a GPU host)
	for l2 in nol2 l2; do
		step "hf-r1-16-$l2" 80 python3 python/examples/hf_roundtrip.py --bin "$BIN" --device "${HF_DEVICE:-cuda}" --ranks 1 --kv-heads 2 \
			--layers 8 --generate 1 --chunks 1024 --blocks-per-chunk 1 --store-reps 4 --restore-reps 6 --timeline \
			$([[ $l2 == nol2 ]] && echo --rankd-arg=--l2-dir=)
	done
	;;
vllm)
	V=(GEOMETRY=8b MODEL_DIR="${MODEL_DIR:-/tmp/kvtier-model-8b}" REPS=1 GPU_MEM="${ITL_GPU_MEM:-0.5}" L1=12GiB CPU_BYTES=10e9
		GRAPHS=1 L2=0 ITL=1 LENGTHS=32769 MODES=kvtier)
	# 24.4 (stop 52, an H100: the decoders during a 32k load 1.19-1.21x with
	# the defaults, 1.18x with kv_sum_units, 1.34x with kv_move): with two
	# restore batches per GiB instead of the ramp's four (fewer kernels of
	# the rankd's context), the defaults in the same call (the first
	# step's bound covers the engine's first torch.compile: 160 s did not on
	# a fresh H100 at stop 54), then
	# kv_sum_units under the connector's pace
	step itl-default 240 env "${V[@]}" OUT_DIR="$R/itl-default" bash scripts/gpu-vllm.sh "$BIN"
	# 25.3/25.5: the default since stop 54 (kv_move beside the other
	# direction) against stop 53's, in vLLM (not measured there yet)
	step itl-nosmcd 100 env "${V[@]}" RANKD_ARGS="--dma-sm-control-duplex=false" OUT_DIR="$R/itl-nosmcd" \
		bash scripts/gpu-vllm.sh "$BIN"
	# 25.4: 16- and 64-token chunks through the Python client, 4 rankds
	# (0.31-0.34 / 0.19-0.21 of CE restoring on the H200 at stop 48, not
	# run since), twice each
	for c in 64:256:4 16:1024:1 64b:256:4 16b:1024:1; do
		IFS=: read -r n chunks per <<<"$c"
		step "hf-$n" 90 python3 python/examples/hf_roundtrip.py --bin "$BIN" --ranks 4 --layers 8 --generate 4 \
			--chunks "$chunks" --blocks-per-chunk "$per"
	done
	# 25.5: vLLM's decoders under MPS (the decode-shaped loop met <= 1.05x
	# there at stop 55 with kv_sum_units, two batches a restore and the
	# rankd on a quarter of the SMs), then the same flags without MPS
	for pct in 25 100; do
		mps_step "itl-mps$pct-units-ramp0" step "itl-mps$pct-units-ramp0" 160 env "${V[@]}" \
			RANKD_ENV="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct" RANKD_ARGS="--dma-unit-sums --retrieve-ramp 0" \
			OUT_DIR="$R/itl-mps$pct-units-ramp0" bash scripts/gpu-vllm.sh "$BIN"
	done
	step itl-units-ramp0 100 env "${V[@]}" RANKD_ARGS="--dma-unit-sums --retrieve-ramp 0" OUT_DIR="$R/itl-units-ramp0" \
		bash scripts/gpu-vllm.sh "$BIN"
	step itl-ramp0 100 env "${V[@]}" RANKD_ARGS="--retrieve-ramp 0" OUT_DIR="$R/itl-ramp0" bash scripts/gpu-vllm.sh "$BIN"
	step itl-units 100 env "${V[@]}" RANKD_ARGS="--dma-unit-sums" OUT_DIR="$R/itl-units" bash scripts/gpu-vllm.sh "$BIN"
	step itl-conn10-units 100 env "${V[@]}" KVTIER_LOAD_PACE_GBPS=10 RANKD_ARGS="--dma-unit-sums" OUT_DIR="$R/itl-conn10-units" \
		bash scripts/gpu-vllm.sh "$BIN"
	# 24.4: >= 10x at 32k against recompute without a connector, and the
	# OffloadingConnector, in one run (8.2x-10.6x at earlier stops)
	step ttft32 240 env "${V[@]}" ITL=0 REPS=3 MODES="alone offload kvtier" OUT_DIR="$R/ttft32" bash scripts/gpu-vllm.sh "$BIN"
	step itl-conn10 100 env "${V[@]}" KVTIER_LOAD_PACE_GBPS=10 OUT_DIR="$R/itl-conn10" bash scripts/gpu-vllm.sh "$BIN"
	step itl-pace10 100 env "${V[@]}" RANKD_ARGS="--restore-pace-gbps 10" OUT_DIR="$R/itl-pace10" \
		bash scripts/gpu-vllm.sh "$BIN"
	step itl-pace20 100 env "${V[@]}" RANKD_ARGS="--restore-pace-gbps 20" OUT_DIR="$R/itl-pace20" \
		bash scripts/gpu-vllm.sh "$BIN"
	step itl-pace10w4 100 env "${V[@]}" RANKD_ARGS="--restore-pace-gbps 10 --restore-pace-window 4ms" OUT_DIR="$R/itl-pace10w4" \
		bash scripts/gpu-vllm.sh "$BIN"
	# 24.4: what 1 MiB copies from another process cost the decoders,
	# beside what a load costs them (docs/gpu.md)
	step itl-pieces 100 env "${V[@]}" ITL_COPY_GB=4 ITL_COPY_PIECE=1048576 OUT_DIR="$R/itl-pieces" \
		bash scripts/gpu-vllm.sh "$BIN"
	# 24.4: the loads' copies without the overlap hint, and one call each
	step itl-nohint 100 env "${V[@]}" RANKD_ARGS=--dma-no-overlap-hint OUT_DIR="$R/itl-nohint" \
		bash scripts/gpu-vllm.sh "$BIN"
	step itl-each 100 env "${V[@]}" RANKD_ARGS=--dma-each-copy OUT_DIR="$R/itl-each" \
		bash scripts/gpu-vllm.sh "$BIN"
	;;
replay)
	# 24.4: the Mooncake replay with CUDA graphs, vLLM alone and with
	# kvtier, a call of its own (two engine starts and the model's creation)
	[[ -n ${TRACE:-} ]] || { echo "$0 replay: TRACE must name the Mooncake trace (JSON lines)" >&2; exit 2; }
	step replay 540 env REPLAY=600 TRACE="$TRACE" GEOMETRY=8b \
		MODEL_DIR="${MODEL_DIR:-/tmp/kvtier-model-8b}" GPU_MEM="${REPLAY_GPU_MEM:-0.2}" L1=48GiB CPU_BYTES=48e9 GRAPHS=1 ITL=0 L2=0 \
		NO_L2=1 MODES="alone kvtier" OUT_DIR="$R/replay" bash scripts/gpu-vllm.sh "$BIN"
	;;
*)
	echo "$0: unknown set $SET (cuda, daemons, vllm or replay)" >&2
	exit 2
	;;
esac
