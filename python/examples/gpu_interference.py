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


def with_traffic(cmd: list[str] | str, step: Any, warm: float, seconds: float, log: str) -> tuple[list[float], int]:
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, shell=isinstance(cmd, str), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        time.sleep(warm)
        if p.poll() is not None:
            raise RuntimeError(f"traffic command exited early (rc {p.returncode}); see {log}")
        return measure(step, seconds), p.pid
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def traffic_rate(log: str) -> dict[str, Any]:
    """The traffic's own rate, from the last progress line of
    enginesim --bench-traffic in its log (gpu-bench.sh prints it when the
    loop is stopped); empty when the command printed none."""
    last: dict[str, Any] = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = re.search(r"bench traffic: (\d+) restores in ([\d.]+) s, ([\d.]+) GB/s", line)
            if m:
                last = {"traffic_restores": int(m[1]), "traffic_s": float(m[2]), "traffic_gbps": float(m[3])}
    if last:
        print(f"interference: the traffic restored {last['traffic_restores']} times in {last['traffic_s']} s, "
              f"{last['traffic_gbps']} GB/s")
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traffic-cmd", required=True, help="shell command that moves bytes through kvtier until killed")
    ap.add_argument("--warm", type=float, default=25.0, help="seconds the traffic runs before the measurement")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dma-bytes", type=float, default=1.3e9)
    ap.add_argument("--logs", default=".", help="directory for the traffic commands' logs (created)")
    a = ap.parse_args()
    os.makedirs(a.logs, exist_ok=True)  # before the minutes of measuring, not after
    step = build(a.batch, a.context)
    measure(step, 3.0)  # warm: kernels, allocator, clocks
    alone = summary("alone", measure(step, a.seconds), None)
    res: dict[str, Any] = {"batch": a.batch, "context": a.context, "device": torch.cuda.get_device_name(),
                           "phases": [alone]}
    kv, _ = with_traffic(a.traffic_cmd, step, a.warm, a.seconds, os.path.join(a.logs, "traffic-kvtier.log"))
    res["phases"].append(summary("while kvtier stores and restores", kv, alone["median_ms"]))
    res["phases"][-1].update(traffic_rate(os.path.join(a.logs, "traffic-kvtier.log")))
    dma, _ = with_traffic([sys.executable, "-c", DMA, str(a.dma_bytes)], step, 8.0, a.seconds,
                          os.path.join(a.logs, "traffic-dma.log"))
    res["phases"].append(summary("while plain DMA copies (copy engine)", dma, alone["median_ms"]))
    res["phases"].append(summary("alone again", measure(step, a.seconds), alone["median_ms"]))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
