#!/usr/bin/env bash
# kvtier daemon-path benchmark: store and restore N GB through real rankds.
#
#   scripts/gpu-bench.sh BIN_DIR            (BIN_DIR holds coordinator, rankd, enginesim)
#
# Makes credentials with 'coordinator init', starts a coordinator (embedded
# NATS with authentication on, bbolt index in a temp dir, memberlist on
# 127.0.0.1) and RANKS rankds on DEVICE (all sharing it, no L2), then runs
# 'enginesim --bench': REPS repetitions of a timed store and a timed restore
# (to the COMPLETE verdict) of a prompt sized so each rank stores GB GB,
# each against a plain copy of the same bytes (copy engine on a GPU, memmove
# on the host backend). Prints the table, writes the JSON result to OUT,
# stops every daemon and exits non-zero on any wrong byte, non-COMPLETE
# verdict or error.
#
# Environment:
#   RANKS=4        1 (scenario tp1) or 4 (scenario tp4dcp4, 4 rankds on one device)
#   SPEC=FILE      an enginesim spec file instead (e.g. enginesim/specs/llama8b-tp1.json, the
#                  Llama-3.1-8B pages vLLM restores into); its layout's tp and dcp replace RANKS
#   DEVICE=cuda:0  or host (the host backend, for a machine without a GPU)
#   GB=1.3         bytes each rank stores per repetition, in GB (1e9 B)
#   REPS=5         repetitions
#   PER=8          chunks per store request (an engine stores what one forward step
#                  completed in one request: 8 chunks of 2,048 tokens per 16,384-token step)
#   JSON=1         engine requests as JSON (--json-requests; default binary)
#   OUT=bench-<scenario>.json  the enginesim result (bench figures under "bench"); a
#                  directory: the file goes inside it
#   L1=            rankd --l1-bytes (default: 2.5 x GB, with DUPLEX 4.6 x GB; at least 256MiB)
#   PROFILE=DIR    CPU profiles of the coordinator and every rankd into DIR
#   RANKD_ARGS=    extra rankd flags (e.g. --retrieve-serial-batches for an A/B run)
#   RANKD_ENV=     VAR=value words in the rankds' environment only (e.g.
#                  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 under MPS: docs/gpu.md)
#   DUPLEX=        N: after the repetitions, N repetitions of a fresh store and the
#                  previous prompt's restore at once (enginesim --bench-duplex: both copy
#                  directions, against plain copies both ways; a consecutive SPEC)
#   TRAFFIC=       a duration (e.g. 10m): after the repetitions, restore the last prompt
#                  again and again for that long (enginesim --bench-traffic: verdicts
#                  checked, bytes not compared), the traffic of gpu_interference.py
#   KEEP=1         keep the temp dir (logs); PORT_BASE picks the ports
set -euo pipefail

BIN=${1:-${BIN:-}}
if [[ -z $BIN ]]; then
	echo "usage: $0 BIN_DIR" >&2
	exit 2
fi
for b in coordinator rankd enginesim; do
	if [[ ! -x $BIN/$b ]]; then
		echo "gpu-bench: $BIN/$b missing" >&2
		exit 2
	fi
done
RANKS=${RANKS:-4}
DEVICE=${DEVICE:-cuda:0}
GB=${GB:-1.3}
REPS=${REPS:-5}
PER=${PER:-8}
JSON_FLAG=
if [[ ${JSON:-0} == 1 ]]; then JSON_FLAG=--json-requests; fi
if [[ -n ${SPEC:-} ]]; then
	[[ -f $SPEC ]] || { echo "gpu-bench: SPEC=$SPEC is not a file" >&2; exit 2; }
	SCENARIO=$(basename "$SPEC")
	SCENARIO=${SCENARIO%.*}
	# layout.tp and layout.dcp, JSON ("tp": 4) or YAML (tp: 4); DCP absent means 1
	field() { sed -nE "s/.*(^|[^A-Za-z_])\"?$1\"?[[:space:]]*:[[:space:]]*([0-9]+).*/\2/p" "$SPEC" | head -n 1; }
	RANKS=$(field tp) DCP=$(field dcp)
	[[ -n $RANKS ]] || { echo "gpu-bench: SPEC=$SPEC names no layout tp" >&2; exit 2; }
	DCP=${DCP:-1}
	SCENARIO_ARGS=(--spec "$SPEC")
else
	case $RANKS in
	1) SCENARIO=tp1 DCP=1 ;;
	4) SCENARIO=tp4dcp4 DCP=4 ;;
	*)
		echo "gpu-bench: RANKS=$RANKS, want 1 or 4" >&2
		exit 2
		;;
	esac
	SCENARIO_ARGS=(--scenario "$SCENARIO")
fi
OUT=${OUT:-bench-$SCENARIO.json}
if [[ -d $OUT ]]; then # a directory (the device tool exports OUT as one): the file goes inside
	OUT=$OUT/bench-$SCENARIO.json
fi
if [[ -z ${L1:-} ]]; then
	# With REPS=1, DUPLEX=3's last repetition holds four prompts (the
	# repetitions' and three stored beside restores) under the high
	# watermark, so no eviction competes with its timing (at 3.6 x GB,
	# stores on the H100 evicted chunks of the restore beside them, which
	# then failed as missing); the repetitions hold two.
	L1=$(awk -v gb="$GB" -v f="${DUPLEX:+4.6}" 'BEGIN { if (f == "") f = 2.5; m = int(gb * f * 1e9 / 1048576) + 1; if (m < 256) m = 256; printf "%dMiB", m }')
fi

BASE=${PORT_BASE:-$((20000 + RANDOM % 20000))}
NATS=nats://127.0.0.1:$BASE
GOSSIP=127.0.0.1:$((BASE + 1))
WORK=$(mktemp -d -t kvtier-bench.XXXXXX)
mkdir -p -m 0700 "$WORK/index" "$WORK/shm" "$WORK/logs"
CREDS=$WORK/creds
PIDS=()
COORD=
WATCH=

prof() { # name: the --cpu-profile flag for a daemon, if PROFILE is set
	if [[ -n ${PROFILE:-} ]]; then
		mkdir -p "$PROFILE"
		echo "--cpu-profile=$PROFILE/$1.pprof"
	fi
}

stop_pid() { # pid: SIGTERM, wait up to 15 s, then SIGKILL
	local pid=$1
	kill -TERM "$pid" 2>/dev/null || return 0
	for _ in $(seq 150); do
		kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
		sleep 0.1
	done
	echo "gpu-bench: pid $pid did not stop in 15 s; killing it" >&2
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$?
	if [[ -n $WATCH ]]; then kill "$WATCH" 2>/dev/null || true; fi
	for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
	[[ -n $COORD ]] && stop_pid "$COORD"
	# TRAFFIC stopped by a signal: its last progress line is the rate it ran at
	if [[ -n ${TRAFFIC:-} && -e $WORK/logs/enginesim.out ]]; then
		grep -E '^enginesim: bench traffic: [0-9]' "$WORK/logs/enginesim.out" | tail -n 1 >&2 || true
	fi
	if [[ $rc -ne 0 ]]; then
		echo "gpu-bench: FAILED (exit $rc); last log lines:" >&2
		for f in "$WORK"/logs/*.log; do
			[[ -e $f ]] || continue
			echo "--- $f" >&2
			tail -n 8 "$f" >&2 || true
		done
	fi
	if [[ ${KEEP:-0} == 1 ]]; then echo "gpu-bench: kept $WORK"; else rm -rf "$WORK"; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$BIN/coordinator" init --dir "$CREDS" --instance engine0 --tp-size "$RANKS" >/dev/null
# shellcheck disable=SC2046
"$BIN/coordinator" serve --data-dir "$WORK/index" --creds-dir "$CREDS" --nats-host 127.0.0.1 --nats-port "$BASE" \
	--bind "$GOSSIP" --http 127.0.0.1:0 --log-level warn $(prof coordinator) >>"$WORK/logs/coordinator.log" 2>&1 &
COORD=$!
up=0
for _ in $(seq 200); do
	if "$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s >/dev/null 2>&1; then
		up=1
		break
	fi
	kill -0 "$COORD" 2>/dev/null || { echo "gpu-bench: coordinator exited" >&2; exit 1; }
	sleep 0.1
done
[[ $up == 1 ]] || { echo "gpu-bench: coordinator not answering after 20 s" >&2; exit 1; }

for ((r = 0; r < RANKS; r++)); do
	# shellcheck disable=SC2046
	env ${RANKD_ENV:-} "$BIN/rankd" --instance engine0 --tp-rank "$r" --tp-size "$RANKS" --dcp-size "$DCP" --device "$DEVICE" \
		--host-dir "$WORK/shm" --l1-bytes "$L1" --join "$GOSSIP" --bind "127.0.0.1:$((BASE + 2 + r))" \
		--http 127.0.0.1:0 --log-level warn --creds-dir "$CREDS" $(prof "rankd$r") ${RANKD_ARGS:-} >>"$WORK/logs/rankd$r.log" 2>&1 &
	PIDS+=($!)
done
alive=0
for _ in $(seq 600); do
	alive=$("$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s 2>/dev/null | awk '$2=="rankd" && $3=="alive"' | wc -l)
	[[ $alive -eq $RANKS ]] && break
	for pid in "${PIDS[@]}"; do
		kill -0 "$pid" 2>/dev/null || { echo "gpu-bench: a rankd exited" >&2; exit 1; }
	done
	sleep 0.1
done
[[ $alive -eq $RANKS ]] || { echo "gpu-bench: $alive of $RANKS rankds joined within 60 s" >&2; exit 1; }
echo "gpu-bench: coordinator + $RANKS rankd(s) on $DEVICE (L1 $L1 each, no L2), scenario $SCENARIO, $GB GB per rank, $REPS repetitions; load average $(cut -d' ' -f1-3 /proc/loadavg)"

# TRAFFIC: one line on stderr once the restore loop runs (after the
# repetitions' stores, restores and byte comparisons), so that a caller
# (gpu_interference.py) measures the loop, not the bench's setup
if [[ -n ${TRAFFIC:-} ]]; then
	(until grep -q '^enginesim: bench traffic: restoring' "$WORK/logs/enginesim.out" 2>/dev/null; do sleep 0.2; done
		echo "gpu-bench: traffic started" >&2) &
	WATCH=$!
fi
"$BIN/enginesim" --nats "$NATS" --creds-dir "$CREDS" --device "$DEVICE" --host-dir "$WORK/shm" --instance engine0 \
	"${SCENARIO_ARGS[@]}" --bench --bench-gb "$GB" --bench-reps "$REPS" --bench-chunks-per-store "$PER" $JSON_FLAG ${TRAFFIC:+--bench-traffic "$TRAFFIC"} ${DUPLEX:+--bench-duplex "$DUPLEX"} \
	--result "$OUT" >"$WORK/logs/enginesim.out" 2>&1 || {
	rc=$?
	tail -n 30 "$WORK/logs/enginesim.out" >&2
	exit $rc
}
sed -n '/^bench /,$p' "$WORK/logs/enginesim.out"
grep -E '^enginesim: bench (repetition|traffic)' "$WORK/logs/enginesim.out" || true
# CPU seconds (user + system) each rankd has used since it started: the
# whole run (warm-up, every repetition's store and restore, idle gossip).
tck=$(getconf CLK_TCK)
cpu=""
for pid in "${PIDS[@]}"; do
	cpu+=" $(awk -v t="$tck" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$pid/stat" 2>/dev/null || echo "?")"
done
echo "gpu-bench: rankd CPU seconds (user+system, whole run):$cpu"
echo "gpu-bench: result in $OUT"
