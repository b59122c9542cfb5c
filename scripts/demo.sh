#!/usr/bin/env bash
# kvtier demo: a whole cluster on one machine, on the host backend.
#
#   make demo            (builds bin/ first)
#
# Makes the cluster's credentials with 'coordinator init' (one nkey per
# identity, the users file with their roles, a gossip key), then starts a
# coordinator (embedded NATS with authentication on, bbolt index in a temp
# dir, keyed memberlist on 127.0.0.1) and 4 rankds (one per TP rank, host backend, shared L2 dir),
# then the engine simulator: TP4/DCP4 and TP4/DCP1 with the seed geometries
# (store in many incremental stores, wipe, restore through the coordinator,
# byte-compare every rank). Then it restarts the rankds and the coordinator
# and restores both prompts again from L2 in a fresh engine process. Exits
# non-zero on any failure; every child is stopped on exit.
#
# Environment: BIN (default bin), DEVICE (default host; cuda:0 on a GPU
# machine runs every rank and the engine on that GPU through CUDA IPC),
# KEEP=1 keeps the temp dir, DEMO_PORT_BASE picks the ports (NATS base,
# gossip base+1, rankds base+2..base+5, HTTP 0).
set -euo pipefail

BIN=${BIN:-bin}
DEVICE=${DEVICE:-host}
for b in coordinator rankd enginesim; do
	if [[ ! -x $BIN/$b ]]; then
		echo "demo: $BIN/$b missing; run 'make build' first" >&2
		exit 1
	fi
done

BASE=${DEMO_PORT_BASE:-$((20000 + RANDOM % 20000))}
NATS_PORT=$BASE
GOSSIP=127.0.0.1:$((BASE + 1))
NATS=nats://127.0.0.1:$NATS_PORT
TP=4
WORK=$(mktemp -d -t kvtier-demo.XXXXXX)
mkdir -p -m 0700 "$WORK/index" "$WORK/shm" "$WORK/l2" "$WORK/logs"
CREDS=$WORK/creds

declare -A PIDS=()

if [[ -t 1 ]]; then B=$'\033[1m' N=$'\033[0m'; else B='' N=''; fi
step() { printf '\n%s==> %s%s\n' "$B" "$*" "$N"; }
info() { printf '    %s\n' "$*"; }

stop_pid() { # name pid: SIGTERM, wait up to 15 s, then SIGKILL
	local name=$1 pid=$2
	kill -TERM "$pid" 2>/dev/null || return 0
	for _ in $(seq 150); do
		kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
		sleep 0.1
	done
	echo "demo: $name (pid $pid) did not stop in 15 s; killing it" >&2
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$?
	for name in "${!PIDS[@]}"; do
		[[ $name == coordinator ]] && continue
		stop_pid "$name" "${PIDS[$name]}"
	done
	[[ -n ${PIDS[coordinator]:-} ]] && stop_pid coordinator "${PIDS[coordinator]}"
	if [[ $rc -ne 0 ]]; then
		echo
		echo "demo: FAILED (exit $rc); last log lines:" >&2
		for f in "$WORK"/logs/*.log; do
			echo "--- $f" >&2
			tail -n 8 "$f" >&2 || true
		done
	fi
	if [[ ${KEEP:-0} == 1 ]]; then
		echo "demo: kept $WORK"
	else
		rm -rf "$WORK"
	fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_coordinator() {
	"$BIN/coordinator" serve --data-dir "$WORK/index" --creds-dir "$CREDS" --nats-host 127.0.0.1 --nats-port "$NATS_PORT" \
		--bind "$GOSSIP" --http 127.0.0.1:0 --log-level warn >>"$WORK/logs/coordinator.log" 2>&1 &
	PIDS[coordinator]=$!
	for _ in $(seq 100); do
		if "$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s >/dev/null 2>&1; then
			info "coordinator up: NATS $NATS, gossip $GOSSIP, index $WORK/index (pid ${PIDS[coordinator]})"
			return 0
		fi
		kill -0 "${PIDS[coordinator]}" 2>/dev/null || { echo "demo: coordinator exited" >&2; return 1; }
		sleep 0.1
	done
	echo "demo: coordinator not answering after 10 s" >&2
	return 1
}

start_rankds() {
	for ((r = 0; r < TP; r++)); do
		"$BIN/rankd" --instance engine0 --tp-rank "$r" --tp-size "$TP" --dcp-size 4 --device "$DEVICE" \
			--host-dir "$WORK/shm" --l1-bytes 256MiB --l2-dir "$WORK/l2" --l2-policy write-through \
			--join "$GOSSIP" --bind "127.0.0.1:$((BASE + 2 + r))" --http 127.0.0.1:0 --log-level warn --creds-dir "$CREDS" \
			>>"$WORK/logs/rankd$r.log" 2>&1 &
		PIDS[rankd$r]=$!
	done
	for _ in $(seq 300); do
		local alive
		alive=$("$BIN/coordinator" members --creds-dir "$CREDS" --nats "$NATS" --timeout 1s 2>/dev/null | awk '$2=="rankd" && $3=="alive"' | wc -l)
		if [[ $alive -eq $TP ]]; then
			info "$TP rankds alive in the cluster (device $DEVICE, L1 256 MiB each, shared L2 $WORK/l2)"
			return 0
		fi
		for ((r = 0; r < TP; r++)); do
			kill -0 "${PIDS[rankd$r]}" 2>/dev/null || { echo "demo: rankd $r exited" >&2; return 1; }
		done
		sleep 0.1
	done
	echo "demo: rankds did not all join within 30 s" >&2
	return 1
}

stop_rankds() {
	for ((r = 0; r < TP; r++)); do
		stop_pid "rankd$r" "${PIDS[rankd$r]}" &
	done
	wait_children_of_stop
	for ((r = 0; r < TP; r++)); do unset "PIDS[rankd$r]"; done
}

wait_children_of_stop() {
	# wait for the background stop_pid jobs only (not the daemons)
	local j
	for j in $(jobs -p); do
		if ! printf '%s\n' "${PIDS[@]}" | grep -qx "$j"; then wait "$j" || true; fi
	done
}

sim() {
	"$BIN/enginesim" --nats "$NATS" --creds-dir "$CREDS" --device "$DEVICE" --host-dir "$WORK/shm" --instance engine0 "$@"
}

t0=$SECONDS
step "kvtier demo in $WORK"
step "credentials: coordinator init (nkeys per identity, users file with roles, gossip key)"
"$BIN/coordinator" init --dir "$CREDS" --instance engine0 --tp-size "$TP" >/dev/null
info "$(ls "$CREDS" | tr '\n' ' ')"

step "starting the coordinator (embedded NATS with auth + bbolt index + keyed memberlist)"
start_coordinator
step "starting $TP rankds"
start_rankds

step "TP4 x DCP4: store in incremental chunks, wipe, restore through the coordinator, compare every byte"
sim --scenario tp4dcp4 --phase all

step "TP4 x DCP1: MLA stored by rank 0, restored on all 4 ranks"
sim --scenario tp4dcp1 --phase all

step "an anonymous client is refused"
if "$BIN/coordinator" members --insecure --nats "$NATS" --timeout 2s >/dev/null 2>"$WORK/logs/anon.log"; then
	echo "demo: an anonymous client was served" >&2
	exit 1
fi
info "$(head -n 1 "$WORK/logs/anon.log")"

step "the coordinator's view"
"$BIN/coordinator" ranks --creds-dir "$CREDS" --nats "$NATS"
"$BIN/coordinator" verify --creds-dir "$CREDS" --nats "$NATS"

step "restart: SIGTERM the rankds and the coordinator (L1 is gone), start them again"
stop_rankds
stop_pid coordinator "${PIDS[coordinator]}"
unset "PIDS[coordinator]"
start_coordinator
start_rankds

step "a new engine process restores both prompts from L2"
sim --scenario tp4dcp4 --phase restore
sim --scenario tp4dcp1 --phase restore
"$BIN/coordinator" restores --creds-dir "$CREDS" --nats "$NATS" | head -n 6

step "clean shutdown"
stop_rankds
stop_pid coordinator "${PIDS[coordinator]}"
unset "PIDS[coordinator]"
info "all processes stopped"

step "demo OK in $((SECONDS - t0)) s"
