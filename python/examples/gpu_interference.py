"""What kvtier's data movement costs the model (issue 25 item 5), on a GPU.

A decode-shaped loop (Llama-3.1-8B geometry, bf16: per layer the QKV, O,
gate/up and down projections of BATCH tokens and the attention read of
BATCH requests' KV of CONTEXT tokens each, 32 layers; random weights) runs
in this process. Its step time (CUDA events, median of the steps) is
measured alone, then while another process moves bytes at full speed:

  kvtier   the given command (scripts/gpu-bench.sh: a coordinator, a rankd
           and enginesim --bench storing and restoring through rankd, with
           kvtier's SM copy kernels and verification), started in its own
           process group and stopped after the measurement
  dma      a plain copy-engine reference: another process copies the same
           size between pinned host memory and the GPU, both directions in
           turn, with cudaMemcpyAsync (no SM kernel)

  gpu_interference.py --traffic-cmd 'RANKS=1 GB=1.3 REPS=1 TRAFFIC=10m bash scripts/gpu-bench.sh .gpu' [--seconds 20]

With TRAFFIC (enginesim --bench-traffic) the bench stores and checks one
prompt, then only restores it, again and again: kvtier's copies run for the
whole measurement. With REPS=1000 and no TRAFFIC most of the time goes to
the bench's own work between its timed parts (generating and filling each
repetition's pages, wiping them, comparing every byte): the H200 run of
2026-12-04 measured 1.18x that way with the copy kernels and 1.18x with
the copy engine forced, which says the slowdown was not kvtier's copies.

Prints one line per phase (median and p90 step ms, ratio to alone) and a
JSON summary on stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

L, H, NQ, NKV, D, MLP = 32, 4096, 32, 8, 128, 14336


def build(batch: int, context: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*s: int) -> torch.Tensor:
        return (torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02).contiguous()

    layers = [dict(qkv=w(H, (NQ + 2 * NKV) * D), o=w(NQ * D, H), gu=w(H, 2 * MLP), down=w(MLP, H),
                   k=w(batch, NKV, context, D), v=w(batch, NKV, context, D)) for _ in range(L)]
    x0 = w(batch, H)

    def step() -> torch.Tensor:
        x = x0
        for ly in layers:
            qkv = x @ ly["qkv"]
            q = qkv[:, : NQ * D].view(batch, NQ, 1, D)
            k = ly["k"].repeat_interleave(NQ // NKV, dim=1)
            v = ly["v"].repeat_interleave(NQ // NKV, dim=1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v).reshape(batch, NQ * D)
            x = x + a @ ly["o"]
            gu = x @ ly["gu"]
            x = x + (torch.nn.functional.silu(gu[:, :MLP]) * gu[:, MLP:]) @ ly["down"]
        return x

    return step


def measure(step: Any, seconds: float) -> list[float]:
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def summary(name: str, ms: list[float], alone: float | None) -> dict[str, Any]:
    ms = sorted(ms)
    med, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
    r = {"phase": name, "steps": len(ms), "median_ms": round(med, 3), "p90_ms": round(p90, 3)}
    if alone:
        r["ratio_to_alone"] = round(med / alone, 3)
    print(f"interference: {name}: {len(ms)} steps, median {med:.3f} ms, p90 {p90:.3f} ms"
          + (f", {med / alone:.3f}x alone" if alone else ""), flush=True)
    return r


DMA = """
import torch, time, sys
n = int(float(sys.argv[1]))
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
moved, t0 = 0, time.perf_counter()
with torch.cuda.stream(s):
    while True:
        d.copy_(h, non_blocking=True); h.copy_(d, non_blocking=True); s.synchronize()
        moved += 2 * n
        if time.perf_counter() - t0 > 5:
            print(f"dma: {moved / (time.perf_counter() - t0) / 1e9:.1f} GB/s", flush=True)
            moved, t0 = 0, time.perf_counter()
"""

# The controls (--controls) separate what kvtier's restores cost the loop:
# another process copies host-to-device in pieces as a restore's copies
# are (pieces), the same with a full-grid reduction over every EVERY bytes
# once they are placed, as rankd's checksum of a transfer (pieces+sum),
# and only such reductions, RATE a second, with no copies (sums).
CONTROL = """
import torch, time, sys
mode, n, piece = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3])
every, rate = int(float(sys.argv[4])), float(sys.argv[5])
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.zeros(n, dtype=torch.uint8, device="cuda")
s, k = torch.cuda.Stream(), torch.cuda.Stream()
acc = torch.zeros((), dtype=torch.int64, device="cuda")
moved = sums = 0
t0 = time.perf_counter()
while True:
    if mode == "sums":
        with torch.cuda.stream(k):
            acc += d[:every].view(torch.int64).sum()
        k.synchronize()
        sums += 1
        time.sleep(max(0.0, sums / rate - (time.perf_counter() - t0)))
    else:
        with torch.cuda.stream(s):
            for off in range(0, n, piece):
                end = min(off + piece, n)
                d[off:end].copy_(h[off:end], non_blocking=True)
                if mode == "pieces+sum" and (end % every == 0 or end == n):
                    e = torch.cuda.Event()
                    e.record(s)
                    k.wait_event(e)
                    with torch.cuda.stream(k):
                        acc += d[max(0, end - every):end].view(torch.int64).sum()
                    sums += 1
        s.synchronize()
        k.synchronize()
        moved += n
    if time.perf_counter() - t0 > 5:
        dt = time.perf_counter() - t0
        print(f"control {mode}: {moved / dt / 1e9:.1f} GB/s, {sums / dt:.0f} sums/s", flush=True)
        moved, sums, t0 = 0, 0, time.perf_counter()
"""


def control_rate(log: str) -> dict[str, Any]:
    """The control's last progress line (GB/s and reductions a second)."""
    last: dict[str, Any] = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = re.search(r"control \S+: ([\d.]+) GB/s, (\d+) sums/s", line)
            if m:
                last = {"control_gbps": float(m[1]), "control_sums_per_s": int(m[2])}
    return last


def with_traffic(cmd: list[str] | str, step: Any, warm: float, seconds: float, log: str,
                 ready: str | None = None, ready_timeout: float = 300.0) -> tuple[list[float], int]:
    """The loop's steps while cmd runs; an error when the traffic exits
    before or during the measurement (the steps would be the loop
    alone's). With ready (a regex), the measurement waits for a line of
    cmd's output that matches it (the traffic's own loop has begun: a
    bench's setup of stores, restores and byte comparisons is not its
    traffic), then warm seconds more; without it, warm seconds."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, shell=isinstance(cmd, str), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        if ready is not None:
            t0 = time.monotonic()
            while not _log_has(log, ready):
                if p.poll() is not None:
                    raise RuntimeError(f"traffic command exited before its loop began (rc {p.returncode}); see {log}")
                if time.monotonic() - t0 > ready_timeout:
                    raise RuntimeError(f"traffic loop not begun after {ready_timeout:g} s (no line matching "
                                       f"{ready!r}); see {log}")
                time.sleep(0.2)
            print(f"interference: the traffic's loop began after {time.monotonic() - t0:.1f} s", flush=True)
        time.sleep(warm)
        if p.poll() is not None:
            raise RuntimeError(f"traffic command exited early (rc {p.returncode}); see {log}")
        steps = measure(step, seconds)
        if p.poll() is not None:
            raise RuntimeError(f"traffic command exited during the measurement (rc {p.returncode}); see {log}")
        return steps, p.pid
    finally:
        _stop(p)


def _log_has(log: str, pattern: str) -> bool:
    with open(log, errors="replace") as f:
        return any(re.search(pattern, line) for line in f)


def _stop(p: subprocess.Popen[bytes]) -> None:
    """Stops p's process group: SIGTERM, then SIGKILL after 20 s. A group
    already gone (the traffic exited) is not an error: the caller's own
    error says why."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    except ProcessLookupError:
        p.wait()


def traffic_rate(log: str, patience: float = 3.0) -> dict[str, Any]:
    """The traffic's own rate, from the last progress line of
    enginesim --bench-traffic in its log (enginesim prints it when the
    loop is stopped, which may be after its parent shell has exited: the
    log is read again for up to `patience` seconds); empty when the
    command printed none (said so)."""
    last: dict[str, Any] = {}
    end = time.monotonic() + patience
    while True:
        with open(log, errors="replace") as f:
            for line in f:
                m = re.search(r"bench traffic: (\d+) restores in ([\d.]+) s, ([\d.]+) GB/s", line)
                if m:
                    last = {"traffic_restores": int(m[1]), "traffic_s": float(m[2]), "traffic_gbps": float(m[3])}
        if last or time.monotonic() >= end:
            break
        time.sleep(0.1)
    if last:
        print(f"interference: the traffic restored {last['traffic_restores']} times in {last['traffic_s']} s, "
              f"{last['traffic_gbps']} GB/s", flush=True)
    else:
        print(f"interference: no traffic rate in {log}", flush=True)
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traffic-cmd", required=True, help="shell command that moves bytes through kvtier until killed")
    ap.add_argument("--warm", type=float, default=3.0,
                    help="seconds the traffic runs before the measurement (after --ready matched)")
    ap.add_argument("--ready", default=r"^gpu-bench: traffic started",
                    help="regex: the measurement waits for a line of the traffic command's output that matches it "
                         "(scripts/gpu-bench.sh prints it when enginesim's restore loop begins); empty: no wait")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for --ready")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dma-bytes", type=float, default=1.3e9)
    ap.add_argument("--logs", default=".", help="directory for the traffic commands' logs (created)")
    ap.add_argument("--controls", action="store_true",
                    help="also the controls: 1 MiB host-to-device pieces from another process, the same with a "
                         "full-grid reduction per --control-every bytes, and such reductions alone")
    ap.add_argument("--control-every", type=float, default=float(1 << 30),
                    help="bytes each control reduction reads (rankd: one checksum kernel per transfer, 1 GiB)")
    ap.add_argument("--control-rate", type=float, default=250.0,
                    help="reductions a second of the sums control (250: 4 ms pace windows)")
    a = ap.parse_args()
    os.makedirs(a.logs, exist_ok=True)  # before the minutes of measuring, not after
    step = build(a.batch, a.context)
    measure(step, 3.0)  # warm: kernels, allocator, clocks
    alone = summary("alone", measure(step, a.seconds), None)
    res: dict[str, Any] = {"batch": a.batch, "context": a.context, "device": torch.cuda.get_device_name(),
                           "phases": [alone]}
    kv, _ = with_traffic(a.traffic_cmd, step, a.warm, a.seconds, os.path.join(a.logs, "traffic-kvtier.log"),
                         a.ready or None, a.ready_timeout)
    res["phases"].append(summary("while kvtier stores and restores", kv, alone["median_ms"]))
    rate = traffic_rate(os.path.join(a.logs, "traffic-kvtier.log"))
    res["phases"][-1].update(rate)
    if a.ready and not rate.get("traffic_restores"):
        # the loop was measured beside something other than restores
        # (the bench's setup): not a measurement of the traffic
        print("interference: INVALID: the traffic completed no restore during the measurement", flush=True)
        res["invalid"] = "no restore during the measurement"
    dma, _ = with_traffic([sys.executable, "-c", DMA, str(a.dma_bytes)], step, 8.0, a.seconds,
                          os.path.join(a.logs, "traffic-dma.log"))
    res["phases"].append(summary("while plain DMA copies (copy engine)", dma, alone["median_ms"]))
    if a.controls:
        every = int(a.control_every)
        for mode, name, rate in (("pieces", "1 MiB pieces", 0.0),
                                 ("pieces+sum", f"1 MiB pieces, a reduction per {every} B", 0.0),
                                 ("sums", f"reductions of {every} B, {a.control_rate:g} a second, no copies",
                                  a.control_rate)):
            log = os.path.join(a.logs, f"control-{mode}.log")
            ms, _ = with_traffic([sys.executable, "-c", CONTROL, mode, str(a.dma_bytes), str(1 << 20), str(every),
                                  str(rate)], step, 8.0, a.seconds, log)
            res["phases"].append(summary(f"control: {name}", ms, alone["median_ms"]))
            res["phases"][-1].update(control_rate(log))
            print(f"interference: control {mode}: {res['phases'][-1]}", flush=True)
    res["phases"].append(summary("alone again", measure(step, a.seconds), alone["median_ms"]))
    print(json.dumps(res))
    return 1 if "invalid" in res else 0


if __name__ == "__main__":
    sys.exit(main())
