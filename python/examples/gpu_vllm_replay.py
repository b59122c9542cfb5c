"""The Mooncake conversation trace replayed through real vLLM (issue 24.4).

The trace (``../shared/data/traces/mooncake_conversation_trace.jsonl``) gives,
per request, its input length, output length and the hash ids of its
512-token blocks: two requests that share a hash id share that block of
prompt. Scaled to the model, every hash id becomes ``512 / scale`` token ids
drawn from a generator seeded by the hash id (so shared blocks are shared
tokens, and a later turn of a conversation extends an earlier one's prefix),
and a prompt is its blocks up to ``input_length / scale`` tokens, capped at
the model's length.

The replay is closed-loop: the first ``n`` requests in trace order, at most
``concurrency`` in vLLM at once, the next one added when one finishes (the
trace's timestamps are not kept: the machine's time is short, so it runs at
the engine's pace). Each request generates ``min(output_length, max_tokens)``
tokens greedily. Reported: wall time, requests/s, prompt tokens/s, TTFT
p50/p90, the generated tokens per request (to compare across modes), and the
connector's counters over the replay for kvtier.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

BLOCK = 512  # tokens per hash id in the Mooncake trace


def load(path: str, n: int, scale: int, max_len: int, vocab: int) -> list[tuple[list[int], int]]:
    """The first n requests of the trace as (prompt token ids, output
    length), scaled down by scale (tokens per hash id: BLOCK // scale)."""
    per = BLOCK // scale
    blocks: dict[int, list[int]] = {}
    out: list[tuple[list[int], int]] = []
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            want = min(max(1, r["input_length"] // scale), max_len)
            toks: list[int] = []
            for h in r["hash_ids"]:
                b = blocks.get(h)
                if b is None:
                    rng = random.Random(h * 7919 + 13)
                    b = blocks[h] = [rng.randrange(100, vocab - 1) for _ in range(per)]
                toks += b
                if len(toks) >= want:
                    break
            out.append((toks[:want], int(r["output_length"])))
    return out


def replay(b: Any, reqs: list[tuple[list[int], int]], concurrency: int, max_tokens: int,
           counters: Any, delta: Any) -> dict[str, Any]:
    """Runs reqs through the engine of b (gpu_vllm_bench.Bench), at most
    concurrency at once, in order."""
    from vllm import SamplingParams

    ttft: dict[str, float] = {}
    added: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    nxt, live = 0, 0
    c0 = counters()
    t0 = time.perf_counter()
    while nxt < len(reqs) or live:
        while live < concurrency and nxt < len(reqs):
            p, out_len = reqs[nxt]
            rid = b.rid("rp")
            index[rid] = nxt
            sp = SamplingParams(temperature=0.0, max_tokens=max(1, min(out_len, max_tokens)), ignore_eos=True)
            added[rid] = time.perf_counter()
            b.eng.add_request(rid, {"prompt_token_ids": p}, sp)
            nxt += 1
            live += 1
        for o in b.eng.step():
            got = list(o.outputs[0].token_ids) if o.outputs else []
            if got and o.request_id not in ttft and o.request_id in added:
                ttft[o.request_id] = time.perf_counter() - added[o.request_id]
            if o.finished and o.request_id in added:
                tokens[o.request_id] = got
                live -= 1
    wall = time.perf_counter() - t0
    t = sorted(ttft.values())
    prompt_tokens = sum(len(p) for p, _ in reqs)
    return {
        "requests": len(reqs), "concurrency": concurrency, "wall_s": wall,
        "requests_per_s": len(reqs) / wall, "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "ttft_ms_p50": 1000 * statistics.median(t) if t else None,
        "ttft_ms_p90": 1000 * t[int(0.9 * (len(t) - 1))] if t else None,
        "tokens": {str(index[r]): v for r, v in tokens.items()},
        "counters": delta(c0, counters()),
    }


def table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows comparing each mode's replay with mode alone's."""
    ref = runs.get("alone", {}).get("replay")
    lines = ["| mode | requests (concurrency) | wall s | requests/s | prompt tokens/s | vs alone | "
             "TTFT p50 / p90 ms | requests whose tokens = alone | kvtier chunks verified / GB loaded |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, r in runs.items():
        rp = r.get("replay")
        if not rp:
            continue
        vs = f"{rp['requests_per_s'] / ref['requests_per_s']:.2f}x" if ref else ""
        eq = ""
        if ref:
            same = sum(1 for k, v in rp["tokens"].items() if ref["tokens"].get(k) == v)
            eq = f"{same} / {len(rp['tokens'])}"
        c = rp.get("counters", {})
        kv = ""
        if mode.startswith("kvtier"):
            kv = f"{c.get('verified_chunks', 0):.0f} / {(c.get('l1_bytes', 0) + c.get('l2_bytes', 0)) / 1e9:.2f}"
        lines.append(f"| {mode} | {rp['requests']} ({rp['concurrency']}) | {rp['wall_s']:.1f} | "
                     f"{rp['requests_per_s']:.2f} | {rp['prompt_tokens_per_s']:.0f} | {vs} | "
                     f"{rp['ttft_ms_p50']:.0f} / {rp['ttft_ms_p90']:.0f} | {eq} | {kv} |")
    return lines
