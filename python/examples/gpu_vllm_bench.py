"""TTFT of real vLLM on a GPU: recompute, vLLM's own OffloadingConnector, kvtier.

Run by scripts/gpu-vllm.sh (which starts the coordinator and the rankd and
sets KVTIER_* in the environment); each mode runs in its own process so
that one vLLM engine holds the GPU at a time:

  gpu_vllm_bench.py make-model --geometry 8b --out DIR     random weights, saved on the GPU machine
  gpu_vllm_bench.py run --mode alone|offload|kvtier --model DIR --out R.json
  gpu_vllm_bench.py table R1.json R2.json R3.json          the table, tokens compared

Prompts are random token ids (seeded: every mode sees the same ones) of
N*1024+1 tokens, so that every cache (vLLM's prefix cache, the offload
connector's 64-token blocks, kvtier's 256-token chunks) holds exactly the
first N*1024 tokens and the hit computes one token. TTFT is the time from
LLMEngine.add_request to the step that returns the first token. Before
every timed run the GPU prefix cache is reset (reset_prefix_cache, not the
connector's), so a hit can only be a load from the connector's tier.

Modes:
  alone    no connector: "recompute" (prefix cache reset before each run)
           and "gpu-prefix" (the same prompt again, vLLM's own GPU prefix
           cache: the same one-token compute as a hit, the token reference
           for the hits)
  offload  vLLM's OffloadingConnector (CPU tier): a first run stores, the
           prefix cache is reset, the second run loads
  kvtier   the kvtier connector: a first run stores (L1, write-through L2),
           reset, hits load from L1 (the coordinator's and rankd's
           counters give the verified chunks and bytes of each hit); with
           --itl, the inter-token latency of 8 decoding requests while the
           longest prompt loads; with --l2, the rankd is restarted (L1 is
           gone), the page cache dropped where allowed, and the hits load
           from L2 files
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

GEOMETRIES = {
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads x 128, MLP 14336, vocab 128256
    "8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
               tie_word_embeddings=False),
    "tiny": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=40960,
                 tie_word_embeddings=False),
}


def log(*a: Any) -> None:
    print("gpu-vllm:", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model


def make_model(geometry: str, out: str) -> None:
    """A random-weight LlamaForCausalLM in bf16, built on the GPU and saved
    with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(out, "config.json")):
        log(f"model {out} exists")
        return
    t = time.perf_counter()
    cfg = LlamaConfig(**GEOMETRIES[geometry])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size="5GB")
    log(f"model {geometry}: {n / 1e9:.2f} B parameters, bf16, saved to {out} in {time.perf_counter() - t:.1f} s")


# ---------------------------------------------------------------- metrics of the daemons


def scrape(url: str | None) -> dict[str, float]:
    """A Prometheus text page as {name{labels}: value}; {} without a URL or on error."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except Exception as e:
        log(f"scrape {url}: {e}")
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        k, _, v = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[k] = float(v)
    return out


WATCH = {
    "verified_chunks": 'kvtier_coord_restore_chunks_total{outcome="verified"}',
    "wrong_chunks": 'kvtier_coord_restore_chunks_total{outcome="bytes_wrong"}',
    "failed_chunks": 'kvtier_coord_restore_chunks_total{outcome="failed"}',
    "l1_bytes": 'kvtier_transfer_bytes_total{direction="retrieve",tier="L1"}',
    "l2_bytes": 'kvtier_transfer_bytes_total{direction="retrieve",tier="L2"}',
    "stored_bytes": 'kvtier_transfer_bytes_total{direction="store",tier="L1"}',
}


def pick(m: dict[str, float], want: str) -> float:
    """The sum of the series of want's metric whose labels include want's
    (a daemon may add labels of its own, in any order)."""
    name, _, labels = want.partition("{")
    need = [x for x in labels.rstrip("}").split(",") if x]
    total = 0.0
    for k, v in m.items():
        kn, _, kl = k.partition("{")
        if kn == name and all(x in kl.rstrip("}").split(",") for x in need):
            total += v
    return total


def counters() -> dict[str, float]:
    m = scrape(os.environ.get("KVTIER_COORD_METRICS"))
    m.update(scrape(os.environ.get("KVTIER_RANKD_METRICS")))
    return {k: pick(m, v) for k, v in WATCH.items()}


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in a}


# ---------------------------------------------------------------- where the CPU goes


def _descendants(root: int) -> list[int]:
    """The pids below root (vLLM's engine core runs in a child process)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        ppid = int(st[st.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def thread_cpu() -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of this process and its
    descendants, by (pid, tid)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], float] = {}
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as f:
                    st = f.read()
                    fields = st[st.rindex(")") + 2:].split()
                    out[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) / tick
    return out


def read_profiles() -> dict[str, dict[str, Any]]:
    """The ProfiledKvtierConnector's latest dumps, by role."""
    import glob

    base = os.environ.get("KVTIER_PROFILE_OUT")
    out: dict[str, dict[str, Any]] = {}
    if not base:
        return out
    for path in glob.glob(base + ".*"):
        if path.endswith(".tmp"):
            continue
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            d = json.load(f)
            out[d["role"]] = d
    return out


def cpu_report(a: dict[tuple[int, int], float], b: dict[tuple[int, int], float], wall: float,
               pa: dict[str, dict[str, Any]], pb: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per-thread CPU over a phase (the busiest threads, kvtier's named),
    and the connector's hook time per engine step when it was profiled."""
    names: dict[int, str] = {}
    for role, d in pb.items():
        names[d["main_tid"]] = f"engine main ({role} connector)"
        for n, tid in d["threads"].items():
            names[tid] = f"{n} ({role})"
    used = sorted(((b[k] - a.get(k, 0.0), k) for k in b), reverse=True)
    top = [{"pid": k[0], "tid": k[1], "thread": names.get(k[1], ""), "cpu_s": round(c, 3),
            "cpu_share": round(c / wall, 3)} for c, k in used[:8] if c > 0]
    kv = sum(c for c, k in used if names.get(k[1], "").startswith("kvtier"))
    # kvtier's threads are known by name only from the profiled connector (PROFILE=1): else unknown
    out: dict[str, Any] = {"wall_s": round(wall, 3), "threads": top,
                           "kvtier_threads_cpu_s": round(kv, 3) if names else None}
    hooks: dict[str, Any] = {}
    for role, d in pb.items():
        before = pa.get(role, {}).get("hooks", {})
        for h, (sec, calls) in d["hooks"].items():
            s0, c0 = before.get(h, [0.0, 0])
            if calls - c0:
                hooks[f"{role}.{h}"] = {"ms_per_step": round(1000 * (sec - s0) / max(steps, 1), 4),
                                        "calls": calls - c0}
    if hooks:
        out["hooks"] = hooks
        out["hook_ms_per_step"] = round(sum(v["ms_per_step"] for v in hooks.values()), 4)
    return out


# ---------------------------------------------------------------- the corruption duel (issue 24.5)


def _flip(buf: Any, at: int) -> dict[str, int]:
    """XORs 0x40 into one byte: in a bf16's high byte that is the top
    exponent bit (the value scales by 2^+-128), in a low byte a mantissa bit."""
    old = buf[at]
    buf[at] = old ^ 0x40
    return {"offset": at, "old": old, "new": buf[at]}


def flip_offload_cpu() -> dict[str, Any]:
    """One byte of a stored block in vLLM's OffloadingConnector CPU tier,
    found by walking the worker connector's objects for its CPU tensors
    (needs the engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    root = get_kv_transfer_group()
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    todo: list[tuple[Any, int]] = [(root, 0)]
    while todo:
        o, depth = todo.pop()
        if id(o) in seen or depth > 10:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu" and o.dim() == 2 and o.numel() >= 1 << 20:
                found.append(o)
            continue
        if isinstance(o, dict):
            todo += [(v, depth + 1) for v in o.values()]
        elif isinstance(o, (list, tuple, set)):
            todo += [(v, depth + 1) for v in o]
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("vllm"):
            todo += [(v, depth + 1) for v in vars(o).values()]
    if not found:
        return {"error": "no CPU tensor found in the offloading worker"}
    t = found[0].view(torch.uint8)
    rows = (t != 0).any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return {"error": "no stored block (every CPU row is zero)", "tensors": len(found)}
    r = rows[0]
    at = (t.shape[1] // 2) | 1
    old = int(t[r, at])
    t[r, at] = old ^ 0x40
    return {"tensors": len(found), "stored_rows": len(rows), "row": r, "offset": at, "old": old, "new": int(t[r, at])}


def flip_l1_segment(d: str) -> dict[str, Any]:
    """One byte in the middle of the first live object of the rankd's
    host-shared L1 segment (layout in transfer/hostl1/segment.go)."""
    import mmap
    import struct

    names = [n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n))]
    for n in names:
        path = os.path.join(d, n)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            if struct.unpack_from("<Q", m, 0)[0] != 0x3147534C3154564B:  # segMagic
                continue
            slots, data_off = struct.unpack_from("<Q", m, 16)[0], struct.unpack_from("<Q", m, 40)[0]
            for i in range(slots):
                base = 4096 + 128 * i
                if struct.unpack_from("<I", m, base + 8)[0] != 1:
                    continue
                off, size = struct.unpack_from("<QQ", m, base + 64)
                at = data_off + off + ((size // 2) | 1)
                return {"segment": n, "slot": i, "object_bytes": size, **_flip(m, at)}
    return {"error": f"no live object in a segment of {d} ({names})"}


def flip_l2(d: str) -> dict[str, Any]:
    """One byte in the payload of the largest L2 object file."""
    files = []
    for dp, _, fs in os.walk(d):
        for n in fs:
            if n.endswith(".tmp") or "incarnation" in dp or "quarantine" in dp:
                continue
            files.append(os.path.join(dp, n))
    if not files:
        return {"error": f"no L2 file under {d}"}
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 4095)
        b = bytearray(f.read(1))
        info = _flip(b, 0)
        f.seek(size - 4095)
        f.write(b)
        f.flush()
        os.fsync(f.fileno())
    info["offset"] = size - 4095
    return {"file": os.path.relpath(path, d), "file_bytes": size, "files": len(files), **info}


def duel(b: Bench, args: argparse.Namespace, p: list[int]) -> dict[str, Any]:
    """Stores p, then serves it from the connector's tier with one byte
    flipped: the OffloadingConnector's CPU copy, or kvtier's L1 copy and
    (after a rankd restart) its L2 copy. Reports the tokens against the
    first, computed run's."""
    ref = b.run(p, args.max_tokens, "ref")
    time.sleep(args.settle)
    out: dict[str, Any] = {"tokens_in": len(p), "reference_tokens": ref["tokens"], "cases": []}

    def hit(case: str, flipped: dict[str, Any] | None) -> None:
        b.reset()
        c0 = counters()
        r = b.run(p, args.max_tokens, case)
        row = {"case": case, "flipped": flipped, "ttft_s": r["ttft_s"], "tokens": r["tokens"],
               "tokens_equal_reference": r["tokens"] == ref["tokens"], "counters": delta(c0, counters())}
        out["cases"].append(row)
        log(f"duel {args.mode} {case}: TTFT {1000 * (r['ttft_s'] or 0):.1f} ms, tokens equal: "
            f"{row['tokens_equal_reference']} {r['tokens'][:8]} vs {ref['tokens'][:8]}; flipped {flipped}; "
            f"counters {row['counters']}")

    hit("clean hit", None)
    if args.mode == "duel-offload":
        hit("CPU tier byte flipped", flip_offload_cpu())
        return out
    hit("L1 byte flipped", flip_l1_segment(os.environ["KVTIER_HOST_L1_DIR"]))
    hit("next hit after the L1 flip", None)
    rr = subprocess.run(["bash", os.environ["KVTIER_RESTART_RANKD"]], capture_output=True, text=True)
    log(f"rankd restarted (rc {rr.returncode}): {rr.stdout.strip()} {rr.stderr.strip()}")
    time.sleep(args.settle + 12)
    hit("L2 byte flipped (L1 gone)", flip_l2(os.environ["KVTIER_L2_DIR"]))
    return out


# ---------------------------------------------------------------- the engine


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        self.args = args
        kw: dict[str, Any] = dict(model=args.model, skip_tokenizer_init=True, enforce_eager=not args.graphs,
                                  gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
                                  enable_prefix_caching=True, seed=0)
        if args.mode == "offload" or args.mode == "duel-offload":
            kw["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"block_size": 64, "cpu_bytes_to_use": int(args.cpu_bytes)}}
        elif args.mode.startswith("kvtier") or args.mode == "duel-kvtier":
            detached = args.mode == "kvtier-detached"
            name, module = "KvtierConnector", "kvtier.vllm"
            if args.profile_connector:
                name, module = "ProfiledKvtierConnector", "kvtier_profiled"
            kw["kv_transfer_config"] = {
                "kv_connector": name, "kv_connector_module_path": module,
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    # detached: nothing listens there, the connector never
                    # attaches (C11): vLLM's connector path without kvtier
                    "kvtier_nats": "nats://127.0.0.1:9" if detached else os.environ["KVTIER_NATS"],
                    "kvtier_instance": os.environ.get("KVTIER_INSTANCE", "engine0"),
                    "kvtier_creds_dir": os.environ["KVTIER_CREDS_DIR"], "kvtier_device": "cuda",
                    "kvtier_attach_wait_s": 1 if detached else 20}}
            if os.environ.get("KVTIER_CHUNK_TOKENS"):
                kw["kv_transfer_config"]["kv_connector_extra_config"]["kvtier_chunk_tokens"] = \
                    int(os.environ["KVTIER_CHUNK_TOKENS"])
            if os.environ.get("KVTIER_LOAD_PACE_GBPS"):  # the connector paces loads beside running requests
                kw["kv_transfer_config"]["kv_connector_extra_config"]["kvtier_load_pace_gbps"] = \
                    float(os.environ["KVTIER_LOAD_PACE_GBPS"])
        t = time.perf_counter()
        self.llm = LLM(**kw)
        self.build_s = time.perf_counter() - t
        self.eng = self.llm.llm_engine
        sc = self.eng.vllm_config.scheduler_config
        self.sched = {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                      "enforce_eager": not args.graphs}
        log(f"mode {args.mode}: engine built in {self.build_s:.1f} s; scheduler {self.sched}")
        self.n = 0

    def rid(self, tag: str) -> str:
        self.n += 1
        return f"{tag}-{self.n}"

    def run(self, tokens: list[int], max_tokens: int, tag: str) -> dict[str, Any]:
        """One request alone: TTFT (add_request to the first token) and its tokens."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        rid = self.rid(tag)
        t0 = time.perf_counter()
        self.eng.add_request(rid, {"prompt_token_ids": tokens}, sp)
        ttft = None
        toks: list[int] = []
        while self.eng.has_unfinished_requests():
            for o in self.eng.step():
                got = list(o.outputs[0].token_ids) if o.outputs else []
                if ttft is None and got:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    toks = got
        total = time.perf_counter() - t0
        return {"ttft_s": ttft, "total_s": total, "tokens": toks}

    def reset(self) -> bool:
        """Resets vLLM's GPU prefix cache (not the connector's). Blocks a
        connector still stores from are held until it reports them sent:
        tiny requests step the engine until the reset succeeds."""
        for i in range(200):
            if self.llm.reset_prefix_cache():
                return True
            self.run([7 + i % 50, 11, 13], 1, "flush")
            time.sleep(0.05)
        log("reset_prefix_cache kept failing")
        return False

    def itl(self, long_prompt: list[int] | None, n: int = 8, decode: int = 400, after: int = 60) -> dict[str, Any]:
        """Inter-token latency of n decoding requests; with long_prompt,
        that request is added once they have decoded `after` tokens."""
        import random

        from vllm import SamplingParams

        rng = random.Random(99)
        sp = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
        ids = []
        for _ in range(n):
            rid = self.rid("dec")
            ids.append(rid)
            self.eng.add_request(rid, {"prompt_token_ids": [rng.randrange(100, 1000) for _ in range(256)]}, sp)
        seen = {r: 0 for r in ids}
        stamps: list[tuple[float, int]] = []  # (time, tokens the decoders got in that step)
        cpu0, prof0, t_cpu0, steps = thread_cpu(), read_profiles(), time.perf_counter(), 0
        long_rid, t_add, t_first = None, None, None
        while self.eng.has_unfinished_requests():
            outs = self.eng.step()
            steps += 1
            now = time.perf_counter()
            got = 0
            for o in outs:
                k = len(o.outputs[0].token_ids) if o.outputs else 0
                if o.request_id in seen:
                    got += k - seen[o.request_id]
                    seen[o.request_id] = k
                elif o.request_id == long_rid and k and t_first is None:
                    t_first = now
            if got:
                stamps.append((now, got))
            if long_prompt is not None and long_rid is None and min(seen.values()) >= after:
                long_rid = self.rid("long")
                t_add = time.perf_counter()
                self.eng.add_request(long_rid, {"prompt_token_ids": long_prompt},
                                     SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        time.sleep(0.6)  # the profiled connector writes its totals twice a second
        cpu = cpu_report(cpu0, thread_cpu(), time.perf_counter() - t_cpu0, prof0, read_profiles(), steps)
        gaps = [(b[0], b[0] - a[0]) for a, b in itertools.pairwise(stamps)]
        out: dict[str, Any] = {"decoders": n, "steps": steps, "cpu": cpu}
        steady = [g for t, g in gaps[5:]]
        if long_prompt is None:
            out["itl_ms_mean"] = 1000 * statistics.mean(steady)
            out["itl_ms_p50"] = 1000 * statistics.median(steady)
            out["itl_ms_max"] = 1000 * max(steady)
            return out
        assert t_add is not None
        end = t_first if t_first is not None else t_add
        during = [g for t, g in gaps if t_add < t <= end + 1e-9] or [g for t, g in gaps if t > t_add][:1]
        before = [g for t, g in gaps[5:] if t <= t_add]
        out.update({"long_ttft_s": None if t_first is None else t_first - t_add,
                    "itl_ms_before_mean": 1000 * statistics.mean(before),
                    "itl_ms_during_mean": 1000 * statistics.mean(during),
                    "itl_ms_during_max": 1000 * max(during), "steps_during": len(during),
                    # every step, and the mean without the first (the request's lookup and
                    # admission) and the last (its own prefill): the steps the load runs beside
                    "itl_ms_during": [round(1000 * g, 3) for g in during],
                    "itl_ms_during_inner_mean": 1000 * statistics.mean(during[1:-1]) if len(during) > 2 else None})
        return out


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 1) for _ in range(length)]


def run_mode(args: argparse.Namespace) -> None:
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    b = Bench(args)
    res: dict[str, Any] = {"mode": args.mode, "build_s": b.build_s, "scheduler": b.sched, "rows": []}
    lengths = [int(x) for x in args.lengths.split(",") if x]
    prompts = {L: prompt(L, 1000 + L, vocab) for L in lengths}
    if args.mode.startswith("duel"):
        res["duel"] = duel(b, args, prompts[min(lengths)])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    b.run(prompt(300, 7, vocab), 4, "warm")  # kernels, allocator
    b.reset()
    if args.replay:
        import gpu_vllm_replay

        if not args.replay_trace:
            raise SystemExit("--replay needs --replay-trace")

        reqs = gpu_vllm_replay.load(args.replay_trace, args.replay, args.replay_scale,
                                    args.max_model_len - 64, vocab)
        log(f"{args.mode} replay: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens")
        res["replay"] = gpu_vllm_replay.replay(b, reqs, args.replay_concurrency, args.replay_max_tokens,
                                               counters, delta)
        log(f"{args.mode} replay: " + json.dumps({k: v for k, v in res["replay"].items() if k != "tokens"}))

    def add(kind: str, L: int, r: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        row = {"kind": kind, "tokens_in": L, "ttft_s": r["ttft_s"], "tokens": r["tokens"]}
        row.update(extra or {})
        res["rows"].append(row)
        log(f"{args.mode} {kind} {L}: TTFT {r['ttft_s'] * 1000:.1f} ms {extra or ''} tokens {r['tokens'][:8]}")

    for L in lengths if args.mode != "kvtier-detached" and not args.replay else []:
        p = prompts[L]
        if args.mode == "alone":
            for _ in range(args.reps):
                b.reset()
                add("recompute", L, b.run(p, args.max_tokens, "rc"))
            for _ in range(args.reps):
                add("gpu-prefix", L, b.run(p, args.max_tokens, "gp"))  # the previous run left it cached
        else:
            b.reset()
            c0 = counters()
            add("miss+store", L, b.run(p, args.max_tokens, "store"))
            time.sleep(args.settle)
            b.reset()
            c1 = counters()
            res.setdefault("stored", {})[L] = delta(c0, c1)
            kind = "offload-hit" if args.mode == "offload" else "kvtier-L1-hit"
            for _ in range(args.reps):
                b.reset()
                c0 = counters()
                r = b.run(p, args.max_tokens, "hit")
                add(kind, L, r, delta(c0, counters()) if args.mode == "kvtier" else None)
    if args.itl and args.mode == "kvtier-detached":
        b.reset()
        res["itl_idle"] = b.itl(None)
        log(f"{args.mode} ITL, no load: {res['itl_idle']}")
    elif args.itl:
        L = max(lengths)
        b.reset()
        res["itl_idle"] = b.itl(None)
        log(f"{args.mode} ITL, no load: {res['itl_idle']}")
        if args.itl_copy_gb:
            # What a plain copy-engine stream over PCIe costs vLLM's decoders,
            # with no connector work at all: another process copies pinned
            # host memory to the GPU again and again for the whole window.
            with plain_copy(args.itl_copy_gb, args.itl_copy_piece) as rate:
                res["itl_copy"] = b.itl(None)
            res["itl_copy"]["copy_gb_s"] = rate()
            log(f"{args.mode} ITL while another process copies host-to-device: {res['itl_copy']}")
        b.reset()
        c0 = counters()
        res["itl_load"] = b.itl(prompts[L])
        res["itl_load"]["counters"] = delta(c0, counters()) if args.mode == "kvtier" else {}
        res["itl_load"]["tokens_in"] = L
        log(f"{args.mode} ITL while a {L}-token prompt {'computes' if args.mode == 'alone' else 'loads'}: "
            f"{res['itl_load']}")
    if args.l2 and args.mode == "kvtier":
        restart = os.environ["KVTIER_RESTART_RANKD"]
        t = time.perf_counter()
        rr = subprocess.run(["bash", restart], capture_output=True, text=True)
        log(f"rankd restarted in {time.perf_counter() - t:.1f} s (rc {rr.returncode}): "
            f"{rr.stdout.strip()} {rr.stderr.strip()}")
        res["l2_note"] = rr.stdout.strip()
        # The connector's link sees the new incarnation and registers again
        # (health check every kvtier_health_check_s): in the run of
        # 2026-12-03 a 3-4 s wait was too short and the first two L2 hits
        # were recomputes ("kvtier not attached").
        time.sleep(args.settle + 12)
        for L in lengths:
            b.reset()
            c0 = counters()
            add("kvtier-L2-hit", L, b.run(prompts[L], args.max_tokens, "l2"), delta(c0, counters()))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"mode {args.mode}: results in {args.out}")


# ---------------------------------------------------------------- the table


def table(paths: list[str]) -> int:
    rows: list[dict[str, Any]] = []
    runs = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        runs[r["mode"]] = r
        rows += r["rows"]
    lengths = sorted({r["tokens_in"] for r in rows})
    ref = {L: next((r["tokens"] for r in rows if r["kind"] == "recompute" and r["tokens_in"] == L), None)
           for L in lengths}
    gpref = {L: next((r["tokens"] for r in rows if r["kind"] == "gpu-prefix" and r["tokens_in"] == L), None)
             for L in lengths}

    def med(kind: str, L: int) -> float | None:
        v = [r["ttft_s"] for r in rows if r["kind"] == kind and r["tokens_in"] == L and r["ttft_s"] is not None]
        return statistics.median(v) if v else None

    kinds = ["recompute", "gpu-prefix", "offload-hit", "kvtier-L1-hit", "kvtier-L2-hit", "miss+store"]
    if rows:
        print("| prompt tokens | path | TTFT ms (median) | runs | vs recompute | vs OffloadingConnector | "
              "tokens = recompute | tokens = GPU prefix hit | kvtier verified chunks / bytes loaded |")
        print("|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for L in lengths:
        rc, off = med("recompute", L), med("offload-hit", L)
        for kind in kinds:
            sel = [r for r in rows if r["kind"] == kind and r["tokens_in"] == L]
            if not sel:
                continue
            m = med(kind, L)
            mode = "kvtier" if kind.startswith("kvtier") else ("offload" if kind == "offload-hit" else "")
            if kind == "miss+store":
                mode = "kvtier/offload (first run)"
            eq_rc = all(r["tokens"] == ref[L] for r in sel) if ref[L] is not None else None
            eq_gp = all(r["tokens"] == gpref[L] for r in sel) if gpref[L] is not None else None
            if kind.endswith("hit") and eq_gp is False and eq_rc is False:
                bad += 1
            ctr = ""
            if kind.startswith("kvtier"):
                parts = []
                for r in sel:
                    gb = (r.get("l1_bytes", 0) + r.get("l2_bytes", 0)) / 1e9
                    l2 = f" (L2 {r['l2_bytes'] / 1e9:.2f} GB)" if r.get("l2_bytes") else ""
                    parts.append(f"{r.get('verified_chunks', 0):.0f} / {gb:.2f} GB{l2}")
                ctr = "; ".join(parts)
            vs_rc = f"{rc / m:.1f}x" if rc and m else ""
            vs_off = f"{m / off:.2f}x TTFT" if off and m and kind.startswith("kvtier") else ""
            n = len([r for r in sel if r['ttft_s'] is not None])
            label = f"{kind} ({mode})" if kind == "miss+store" else kind
            print(f"| {L} | {label} | {m * 1000:.1f} | {n} | {vs_rc} | {vs_off} | {eq_rc} | {eq_gp} | {ctr} |")
    if any(r.get("itl_idle") for r in runs.values()):
        print("\n| mode | ITL no load (mean / p50 ms) | ITL while the long prompt arrives (before / during / max ms) | "
              "steps | long TTFT ms | connector hooks ms/step | kvtier threads CPU s |")
        print("|---|---|---|---|---|---|---|")
    for mode, r in runs.items():
        idle, ld = r.get("itl_idle"), r.get("itl_load")
        if not idle:
            continue
        cp = r.get("itl_copy")
        if cp:
            ratio = cp["itl_ms_mean"] / idle["itl_ms_mean"]
            print(f"| {mode}, no load, another process copying host-to-device at {cp.get('copy_gb_s')} GB/s | "
                  f"{cp['itl_ms_mean']:.1f} / {cp['itl_ms_p50']:.1f} ({ratio:.2f}x) | | | | | |")
        during = (f"{ld['itl_ms_before_mean']:.1f} / {ld['itl_ms_during_mean']:.1f} / {ld['itl_ms_during_max']:.1f}"
                  if ld else "")
        lt = f"{1000 * ld['long_ttft_s']:.0f}" if ld and ld.get("long_ttft_s") else ""
        cpu = idle.get("cpu", {})
        print(f"| {mode} | {idle['itl_ms_mean']:.1f} / {idle['itl_ms_p50']:.1f} | {during} | "
              f"{ld.get('steps_during', '') if ld else ''} | {lt} | {cpu.get('hook_ms_per_step', '')} | "
              f"{'' if cpu.get('kvtier_threads_cpu_s') is None else cpu['kvtier_threads_cpu_s']} |")
    if any("replay" in r for r in runs.values()):
        import gpu_vllm_replay

        print("")
        print("\n".join(gpu_vllm_replay.table(runs)))
    for mode, r in runs.items():
        for k in ("itl_idle", "itl_copy", "itl_load"):
            if k in r:
                print(f"{mode} {k}: {json.dumps(r[k])}")
        print(f"{mode}: engine built in {r['build_s']:.1f} s, {r['scheduler']}")
        d = r.get("duel")
        if d:
            for c in d["cases"]:
                print(f"duel {mode} | {c['case']} | tokens equal reference: {c['tokens_equal_reference']} | "
                      f"TTFT {1000 * (c['ttft_s'] or 0):.1f} ms | flipped {c['flipped']} | {c['counters']}")
    return 1 if bad else 0


_COPY_LOOP = """
import signal, sys, time, torch
n = int(float(sys.argv[1]) * 1e9)
piece = int(sys.argv[2]) or n  # bytes a copy: one copy of n, or n/piece of them
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
copied, t0 = 0, None
print("ready", flush=True)
with torch.cuda.stream(s):
    while not stop:
        for off in range(0, n, piece):
            d[off:off + piece].copy_(h[off:off + piece], non_blocking=True)
        s.synchronize()
        if t0 is None:
            t0 = time.perf_counter()
        else:
            copied += n
print(f"{copied / max(time.perf_counter() - (t0 or 0), 1e-9) / 1e9:.1f}", flush=True)
"""


@contextlib.contextmanager
def plain_copy(gb: float, piece: int = 0) -> Any:
    """Runs a host-to-device copy loop of gb GB in another process (its own
    CUDA context, as a rankd's) for the with block, in copies of piece bytes
    (0: one copy); yields a function that returns the loop's GB/s once the
    block is left."""
    p = subprocess.Popen([sys.executable, "-c", _COPY_LOOP, str(gb), str(piece)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError("the copy loop did not start")
    time.sleep(1.0)
    got: list[float] = []
    try:
        yield lambda: got[0] if got else None
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
        with contextlib.suppress(ValueError, IndexError):
            got.append(float(out.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    m.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=["alone", "offload", "kvtier", "kvtier-detached", "duel-offload", "duel-kvtier"],
                   required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--lengths", default="4097,16385,32769")
    r.add_argument("--reps", type=int, default=2)
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--max-model-len", type=int, default=33792)
    r.add_argument("--gpu-mem", type=float, default=0.5)
    r.add_argument("--cpu-bytes", type=float, default=16e9)
    r.add_argument("--settle", type=float, default=1.0, help="seconds after a store before the hits")
    r.add_argument("--graphs", action="store_true", help="CUDA graphs (default: enforce_eager)")
    r.add_argument("--itl", action="store_true")
    r.add_argument("--l2", action="store_true")
    r.add_argument("--itl-copy-gb", type=float, default=0.0, metavar="GB",
                   help="with --itl: also measure the idle ITL while another process copies GB of pinned host "
                        "memory to the GPU in a loop (what PCIe traffic alone costs the decoders)")
    r.add_argument("--itl-copy-piece", type=int, default=0, metavar="BYTES",
                   help="the copy loop of --itl-copy-gb in copies of this many bytes (0: one copy), as a "
                        "restore's copies are (1 MiB a pool and chunk at the 8B geometry)")
    r.add_argument("--replay", type=int, default=0, metavar="N",
                   help="replay the first N requests of --replay-trace (gpu_vllm_replay.py) instead of the TTFT rows")
    r.add_argument("--replay-trace", help="the Mooncake trace (JSON lines)")
    r.add_argument("--replay-scale", type=int, default=8,
                   help="trace tokens per model token (512-token blocks become 512/scale)")
    r.add_argument("--replay-concurrency", type=int, default=16)
    r.add_argument("--replay-max-tokens", type=int, default=8)
    r.add_argument("--profile-connector", action="store_true",
                   help="load kvtier_profiled.ProfiledKvtierConnector: hook times per step in the ITL results")
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    a = ap.parse_args()
    if a.cmd == "make-model":
        make_model(a.geometry, a.out)
        return 0
    if a.cmd == "run":
        if a.mode == "duel-offload":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the flip needs the worker in this process
        run_mode(a)
        return 0
    return table(a.results)


if __name__ == "__main__":
    sys.exit(main())
