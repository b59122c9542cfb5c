#!/usr/bin/env bash
# Real vLLM on a GPU with kvtier: TTFT of recompute, vLLM's own
# OffloadingConnector and kvtier, side by side in one run.
#
#   scripts/gpu-vllm.sh BIN_DIR        (BIN_DIR holds coordinator and rankd)
#
# Makes credentials with 'coordinator init', starts a coordinator (embedded
# NATS with authentication, bbolt index, memberlist on 127.0.0.1) and one
# rankd on DEVICE with an L1 of L1 bytes and a write-through L2 directory,
# makes a random-weight model (GEOMETRY, bf16, built on the GPU and saved
# with save_pretrained) unless MODEL_DIR holds one, then runs
# python/examples/gpu_vllm_bench.py once per mode, each in its own process:
# alone (no connector: recompute and vLLM's GPU prefix-cache hit),
# offload (vLLM's OffloadingConnector, CPU tier) and kvtier (the kvtier
# connector: L1 hits, with ITL=1 the inter-token latency of 8 decoding
# requests while the longest prompt loads, with L2=1 hits from L2 after
# the rankd is restarted). Prints the table (tokens compared with vLLM
# alone) and leaves the JSON results in OUT_DIR.
#
# Needs vLLM (0.26.0 on the H200 machine) and kvtier's Python package
# importable by python3 (PYTHONPATH); docs/gpu.md says how.
#
# Environment:
#   DEVICE=cuda:0      the rankd's device (vLLM uses the first visible GPU)
#   GEOMETRY=8b        8b (Llama-3.1-8B: 32 layers, 4096 hidden, 8 KV heads x 128) or tiny
#   MODEL_DIR=/tmp/kvtier-model-$GEOMETRY
#   LENGTHS=4097,16385,32769   prompt tokens (N*1024+1: every cache holds N*1024, the hit computes 1)
#   MODES="alone offload kvtier"
#   REPS=2             timed runs per path and length
#   L1=12GiB           rankd --l1-bytes
#   ITL=1 L2=1         the ITL and L2 phases of the kvtier mode
#   ITL_COPY_GB=       with ITL: also the idle ITL while another process copies that many GB
#                      host-to-device in a loop (what PCIe traffic alone costs the decoders);
#                      ITL_COPY_PIECE=1048576 makes that loop copies of 1 MiB, as a restore's
#   GPU_MEM=0.5        vLLM gpu_memory_utilization
#   CPU_BYTES=10e9     the OffloadingConnector's cpu_bytes_to_use
#   OUT_DIR=gpu-vllm-results   KEEP=1 keeps the temp dir (logs); PORT_BASE picks the ports
#   HOST_L1=0          1: the rankd keeps L1 in a host-shared segment (/dev/shm), which the
#                      duel-kvtier mode needs to flip a byte of an L1 copy
#   GRAPHS=0           1: vLLM captures CUDA graphs (default: enforce_eager)
#   RANKD_ARGS=        extra rankd flags (e.g. --copy-path dma: restores by the copy engine)
#   RANKD_ENV=         VAR=value words in the rankd's environment only (e.g.
#                      CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 under MPS: docs/gpu.md)
#   PROFILE=0          1: kvtier modes load kvtier_profiled.ProfiledKvtierConnector (hook
#                      times per engine step in the ITL results)
#   L2_BYTES=          rankd --l2-bytes (unset: unbounded; the L2 directory shares the disk
#                      with the coordinator's index); NO_L2=1: no L2 directory, L1 only
#   KVTIER_CHUNK_TOKENS=  the connector's chunk (kvtier_chunk_tokens; unset: 256)
#   KVTIER_LOAD_PACE_GBPS=  the connector's kvtier_load_pace_gbps (unset: off): loads that start beside
#                      running requests paced, a lone hit at full speed
#   REPLAY=0           N: instead of the TTFT rows, replay the first N requests of the
#                      Mooncake trace TRACE (python/examples/gpu_vllm_replay.py: 512-token
#                      blocks scaled by REPLAY_SCALE=8, REPLAY_CONCURRENCY=16 in flight) in
#                      every mode; the table compares throughput and tokens with mode alone
# Modes besides the three: kvtier-detached (the connector configured but never
# attached: vLLM's connector path without kvtier; ITL only), duel-offload and
# duel-kvtier (issue 24.5: one byte flipped in the OffloadingConnector's CPU
# copy, in kvtier's L1 and in its L2 copy; tokens against the computed run).
set -euo pipefail

BIN=${1:-${BIN:-}}
if [[ -z $BIN ]]; then
	echo "usage: $0 BIN_DIR" >&2
	exit 2
fi
for b in coordinator rankd; do
	[[ -x $BIN/$b ]] || { echo "gpu-vllm: $BIN/$b missing" >&2; exit 2; }
done
BIN=$(cd "$BIN" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
DRIVER=$HERE/python/examples/gpu_vllm_bench.py
DEVICE=${DEVICE:-cuda:0}
GEOMETRY=${GEOMETRY:-8b}
MODEL_DIR=${MODEL_DIR:-/tmp/kvtier-model-$GEOMETRY}
LENGTHS=${LENGTHS:-4097,16385,32769}
MODES=${MODES:-alone offload kvtier}
REPS=${REPS:-2}
L1=${L1:-12GiB}
GPU_MEM=${GPU_MEM:-0.5}
CPU_BYTES=${CPU_BYTES:-10e9}
OUT_DIR=${OUT_DIR:-gpu-vllm-results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

BASE=${PORT_BASE:-$((20000 + RANDOM % 20000))}
NATS=nats://127.0.0.1:$BASE
GOSSIP=127.0.0.1:$((BASE + 1))
RANKD_HTTP=127.0.0.1:$((BASE + 3))
COORD_HTTP=127.0.0.1:$((BASE + 4))
WORK=$(mktemp -d -t kvtier-vllm.XXXXXX)
mkdir -p -m 0700 "$WORK/index" "$WORK/l2" "$WORK/logs"
L1ARGS=
# L2_BYTES bounds the L2 directory (rankd --l2-bytes: it shares the disk
# with the coordinator's index, which a full disk stops); NO_L2=1 runs the
# rankd with L1 only.
L2ARGS="--l2-dir $WORK/l2${L2_BYTES:+ --l2-bytes $L2_BYTES}"
[[ ${NO_L2:-0} == 1 ]] && L2ARGS=
if [[ ${HOST_L1:-0} == 1 ]]; then
	L1DIR=$(mktemp -d -p /dev/shm kvtier-l1.XXXXXX)
	chmod 0700 "$L1DIR"
	L1ARGS="--host-l1-dir $L1DIR"
	export KVTIER_HOST_L1_DIR=$L1DIR
fi
export KVTIER_L2_DIR=$WORK/l2
CREDS=$WORK/creds
COORD=

stop_pid() { # pid: SIGTERM, wait up to 15 s, then SIGKILL
	local pid=$1
	kill -TERM "$pid" 2>/dev/null || return 0
	for _ in $(seq 150); do
		kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
		sleep 0.1
	done
	echo "gpu-vllm: pid $pid did not stop in 15 s; killing it" >&2
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$?
	[[ -s $WORK/rankd.pid ]] && stop_pid "$(cat "$WORK/rankd.pid")"
	[[ -n $COORD ]] && stop_pid "$COORD"
	if [[ $rc -ne 0 ]]; then
		echo "gpu-vllm: FAILED (exit $rc); last log lines:" >&2
		for f in "$WORK"/logs/*.log; do
			[[ -e $f ]] || continue
			echo "--- $f" >&2
			tail -n 15 "$f" >&2 || true
		done
	fi
	cp "$WORK"/logs/*.log "$OUT_DIR/" 2>/dev/null || true
	if [[ ${KEEP:-0} == 1 ]]; then echo "gpu-vllm: kept $WORK"; else rm -rf "$WORK" "${L1DIR:-/nonexistent}"; fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$BIN/coordinator" init --dir "$CREDS" --instance engine0 --tp-size 1 >/dev/null
"$BIN/coordinator" serve --data-dir "$WORK/index" --creds-dir "$CREDS" --nats-host 127.0.0.1 --nats-port "$BASE" \
	--bind "$GOSSIP" --http "$COORD_HTTP" --log-level warn >>"$WORK/logs/coordinator.log" 2>&1 &
COORD=$!

# The rankd is started by a script of its own, so the driver can restart it
# (the L2 phase): it stops the running one (SIGTERM) and starts a new one
# with the same flags, then waits until the coordinator sees it alive.
cat >"$WORK/rankd.sh" <<EOF
#!/usr/bin/env bash
set -u
if [[ -s $WORK/rankd.pid ]]; then
	pid=\$(cat $WORK/rankd.pid)
	kill -TERM "\$pid" 2>/dev/null
	for _ in \$(seq 150); do kill -0 "\$pid" 2>/dev/null || break; sleep 0.1; done
	kill -KILL "\$pid" 2>/dev/null
	sync
	if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then echo "page cache dropped"; else echo "page cache NOT dropped (not allowed here)"; fi
fi
setsid env ${RANKD_ENV:-} "$BIN/rankd" --instance engine0 --tp-rank 0 --tp-size 1 --dcp-size 1 --device "$DEVICE" \\
	--l1-bytes "$L1" $L1ARGS $L2ARGS --join "$GOSSIP" --bind "127.0.0.1:$((BASE + 2))" \\
	--http "$RANKD_HTTP" --log-level warn --creds-dir "$CREDS" ${RANKD_ARGS:-} >>"$WORK/logs/rankd.log" 2>&1 </dev/null &
echo \$! >$WORK/rankd.pid
for _ in \$(seq 600); do
	if "$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s 2>/dev/null | awk '\$2=="rankd" && \$3=="alive"' | grep -q .; then
		echo "rankd up (pid \$(cat $WORK/rankd.pid))"
		exit 0
	fi
	kill -0 "\$(cat $WORK/rankd.pid)" 2>/dev/null || { echo "rankd exited" >&2; exit 1; }
	sleep 0.1
done
echo "rankd not alive after 60 s" >&2
exit 1
EOF
up=0
for _ in $(seq 200); do
	if "$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s >/dev/null 2>&1; then
		up=1
		break
	fi
	kill -0 "$COORD" 2>/dev/null || { echo "gpu-vllm: coordinator exited" >&2; exit 1; }
	sleep 0.1
done
[[ $up == 1 ]] || { echo "gpu-vllm: coordinator not answering after 20 s" >&2; exit 1; }
bash "$WORK/rankd.sh"
echo "gpu-vllm: coordinator + 1 rankd on $DEVICE (L1 $L1, L2 $WORK/l2 write-through); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true)"

export KVTIER_NATS=$NATS KVTIER_CREDS_DIR=$CREDS KVTIER_INSTANCE=engine0 \
	KVTIER_COORD_METRICS=http://$COORD_HTTP/metrics KVTIER_RANKD_METRICS=http://$RANKD_HTTP/metrics \
	KVTIER_RESTART_RANKD=$WORK/rankd.sh
export KVTIER_PROFILE_OUT=$WORK/profile PYTHONPATH=$HERE/python/examples${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1} VLLM_LOOPBACK_IP=${VLLM_LOOPBACK_IP:-127.0.0.1}

python3 "$DRIVER" make-model --geometry "$GEOMETRY" --out "$MODEL_DIR"
results=()
for mode in $MODES; do
	extra=()
	if [[ ${REPLAY:-0} != 0 ]]; then
		extra+=(--replay "$REPLAY" --replay-trace "$TRACE" --replay-scale "${REPLAY_SCALE:-8}"
			--replay-concurrency "${REPLAY_CONCURRENCY:-16}")
	else
		[[ $mode == kvtier && ${L2:-1} == 1 ]] && extra+=(--l2)
		[[ $mode != duel-* && ${ITL:-1} == 1 ]] && extra+=(--itl)
		[[ $mode != duel-* && ${ITL:-1} == 1 && -n ${ITL_COPY_GB:-} ]] && extra+=(--itl-copy-gb "$ITL_COPY_GB" --itl-copy-piece "${ITL_COPY_PIECE:-0}")
	fi
	[[ $mode == kvtier* && ${PROFILE:-0} == 1 ]] && extra+=(--profile-connector)
	[[ ${GRAPHS:-0} == 1 ]] && extra+=(--graphs)
	python3 "$DRIVER" run --mode "$mode" --model "$MODEL_DIR" --lengths "$LENGTHS" --reps "$REPS" \
		--gpu-mem "$GPU_MEM" --cpu-bytes "$CPU_BYTES" --out "$OUT_DIR/$mode.json" "${extra[@]}" 2>&1 | tee "$WORK/logs/vllm-$mode.log" |
		grep -E '^gpu-vllm:|Error|error|Traceback|kvtier' | grep -v 'DEBUG' || true
	[[ -s $OUT_DIR/$mode.json ]] || { echo "gpu-vllm: mode $mode wrote no result" >&2; exit 1; }
	results+=("$OUT_DIR/$mode.json")
done
python3 "$DRIVER" table "${results[@]}" | tee "$OUT_DIR/table.md"
