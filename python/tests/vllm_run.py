"""Runs real vLLM (its CPU build) on a local model directory, with or without
the kvtier connector, and writes what it generated as JSON. One process is
one vLLM lifetime: test_vllm_real.py runs it as a subprocess so that
"restart vLLM" is a new process.

    python vllm_run.py ARGS.json OUT.json

ARGS: {"model": dir, "extra": kv_connector_extra_config or null (no
connector), "hma": true/false/absent (force vLLM's hybrid KV cache manager
on or off, or let vLLM decide), "runner": "v1"/"v2"/absent (vLLM's model
runner: VLLM_USE_V2_MODEL_RUNNER=0/1, or vLLM's choice), "block_size": n,
"num_blocks": n, "engine_kw": {more of vLLM's LLM arguments} (optional),
"steps": [{"op": "generate", "prompts": [[ids...]],
"max_tokens": n, "salts": [salt or null per prompt] (optional: vLLM's
per-request cache_salt), "load_delay_s": s (optional: every load the
worker connector starts in this generate waits s seconds before it goes to
the rankd, a slow load as vLLM sees it)} | {"op": "reset"} | {"op": "wipe"} |
{"op": "hook", "file": path} | {"op": "attached", "timeout": s, "worker_attaches": n} |
{"op": "sleep", "s": s}]}. "reset" waits until vLLM's prefix cache is
empty (reset_prefix_cache succeeds); "wipe" then zeroes vLLM's KV tensors
(those its attention layers read), so a later hit can only come from a
load. A "hook" step waits until the file exists (the test does
something to the daemons meanwhile) and then goes on. An "attached" step
waits until the connector's links (worker and scheduler) are attached (and,
with worker_attaches, until the worker's link has attached that often).

OUT: one record per step: generated token ids, each token's logprob as
float.hex (exact), vLLM's num_cached_tokens, and the connector's worker and
scheduler counters after the step (the worker's with "recent_loads": its
last loads, each with the engine steps from start to report); the first
record names the model runner class that ran ("runner").

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
worker-side connector is vLLM's own instance, read through
get_kv_transfer_group()."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


_load_delay_s = 0.0


def _delay_loads(s: float) -> None:
    """Makes every load the worker connector starts from now on wait s
    seconds on the client's loop before its retrieve goes to the rankd (0:
    none). The engine runs in this process, so patching the class reaches
    vLLM's own connector instance."""
    global _load_delay_s
    from kvtier.vllm.connector import KvtierConnector

    if s > 0 and not getattr(KvtierConnector, "_test_delay", False):
        inner = KvtierConnector._load_inner

        async def delayed(self: Any, c: Any, sess: Any, load: Any, *rest: Any) -> Any:
            if _load_delay_s > 0:
                await asyncio.sleep(_load_delay_s)
            return await inner(self, c, sess, load, *rest)

        KvtierConnector._load_inner = delayed  # type: ignore[method-assign]
        KvtierConnector._test_delay = True  # type: ignore[attr-defined]
    _load_delay_s = s


def _stats(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            conn = get_kv_transfer_group()
            out["worker"] = dict(conn.stats, recent_loads=list(conn.recent_loads))
    except Exception as e:  # reported, the test decides
        out["worker_error"] = repr(e)
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        conn = getattr(sched, "connector", None)
        if conn is not None:
            out["scheduler"] = dict(conn.stats)
        # vLLM's KV cache groups: spec class, sliding window, layer count
        out["groups"] = [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                          len(g.layer_names)] for g in sched.kv_cache_config.kv_cache_groups]
    except Exception as e:
        out["scheduler_error"] = repr(e)
    return out


def _keys(prompts: list[list[int]], salts: list[str | None]) -> list[list[str]] | None:
    """Each prompt's L2 object names (shard 0, group 0), from the worker
    connector's own resolved spec and the prompt's cache salt."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvtier import dcp
    from kvtier.vllm.spec import request_chunk_hashes

    if not has_kv_transfer_group():
        return None
    r = get_kv_transfer_group().resolved
    return [[str(dcp.Key(r.namespace, h, 0, 0)) for h in request_chunk_hashes(r, p, s)]
            for p, s in zip(prompts, salts, strict=True)]


def _load_async() -> bool | None:
    """Whether the worker's connector loads asynchronously (it may
    overrule kvtier_load_async: kvtier.vllm._core.sync_loads_unsafe)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return bool(get_kv_transfer_group().cfg.load_async) if has_kv_transfer_group() else None


def _loads_off() -> str | None:
    """Why the worker's connector offers no load ("" when it does; None
    without a connector): kvtier.vllm._core's loads_off."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return str(get_kv_transfer_group().loads_off) if has_kv_transfer_group() else None


def _runner(llm: Any) -> str:
    """The model runner class the worker runs (vLLM's V1 or V2 runner)."""
    try:
        mr = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        return f"{type(mr).__module__}.{type(mr).__name__}"
    except Exception as e:  # reported, the test decides
        return f"unknown: {e!r}"


def _kv_tensors(llm: Any) -> list[Any]:
    import torch

    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    out: dict[int, Any] = {}
    for layer in ctx.values():
        kv = getattr(layer, "kv_cache", None)
        for t in [kv] if isinstance(kv, torch.Tensor) else list(kv or []):
            if isinstance(t, torch.Tensor) and t.numel():
                out[id(t)] = t
    return list(out.values())


def _reset(llm: Any, timeout: float = 60.0) -> bool:
    """Steps the engine until reset_prefix_cache succeeds: every finished
    request's blocks are back (the connector holds them while stores may
    still read them) and vLLM's prefix cache is empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llm.reset_prefix_cache():
            return True
        llm.llm_engine.step()
        time.sleep(0.05)
    return False


def _drain(llm: Any, timeout: float = 60.0) -> bool:
    """Steps the engine until the worker connector has no store in flight
    (vLLM's prefix cache is left as it is)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    conn = get_kv_transfer_group()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not conn._pending and not conn._saving:
            return True
        llm.llm_engine.step()
        time.sleep(0.05)
    return False


def main() -> None:
    with open(sys.argv[1]) as f:
        args = json.load(f)
    if args.get("runner") is not None:  # before vLLM reads its environment
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = {"v1": "0", "v2": "1"}[args["runner"]]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(model=args["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                              max_model_len=args.get("max_model_len", 512), max_num_seqs=args.get("max_num_seqs", 8),
                              enable_prefix_caching=True, block_size=args["block_size"], seed=0,
                              num_gpu_blocks_override=args["num_blocks"])
    if os.environ.get("KVTIER_TEST_DEVICE", "host") != "host":  # vLLM's GPU build beside a rankd on that GPU
        kw["gpu_memory_utilization"] = float(os.environ.get("KVTIER_TEST_GPU_MEM", "0.3"))
    kw.update(args.get("engine_kw") or {})  # more of LLM's arguments (max_num_batched_tokens, ...)
    if args.get("hma") is not None:  # True: force the hybrid KV cache manager on; False: off
        kw["disable_hybrid_kv_cache_manager"] = not args["hma"]
    if args.get("extra") is not None:
        kw["kv_transfer_config"] = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
                                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": args["extra"]}
    t0 = time.monotonic()
    llm = LLM(**kw)
    records: list[dict[str, Any]] = [{"op": "init", "s": round(time.monotonic() - t0, 2), "runner": _runner(llm),
                                      "load_async": _load_async(), "loads_off": _loads_off(),
                                      **_stats(llm)}]
    for step in args["steps"]:
        t = time.monotonic()
        rec: dict[str, Any] = {"op": step["op"]}
        if step["op"] == "generate":
            with open(sys.argv[2] + ".generating", "a") as f:
                f.write(f"{len(records)}\n")
            _delay_loads(float(step.get("load_delay_s", 0.0)))
            sp = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"], logprobs=0, detokenize=False,
                                ignore_eos=True)
            salts = step.get("salts") or [None] * len(step["prompts"])
            prompts = [TokensPrompt(prompt_token_ids=p) if s is None else TokensPrompt(prompt_token_ids=p, cache_salt=s)
                       for p, s in zip(step["prompts"], salts, strict=True)]
            outs = llm.generate(prompts, sp, use_tqdm=False)
            rec["outputs"] = []
            for o in outs:
                c = o.outputs[0]
                lps = [float(d[tok].logprob).hex() for tok, d in zip(c.token_ids, c.logprobs or [], strict=False)]
                rec["outputs"].append({"tokens": list(c.token_ids), "logprobs": lps,
                                       "cached": o.num_cached_tokens})
            rec["drained"] = _drain(llm)
            rec["keys"] = _keys(step["prompts"], salts)
        elif step["op"] == "reset":
            rec["ok"] = _reset(llm)
        elif step["op"] == "wipe":  # after a reset: zero vLLM's own KV tensors, so nothing stale can help
            kv = _kv_tensors(llm)
            for tsr in kv:
                tsr.zero_()
            rec["tensors"] = len(kv)
            rec["nonzero"] = sum(int(tsr.count_nonzero()) for tsr in kv)
        elif step["op"] == "sleep":  # the client's think time between requests
            time.sleep(step["s"])
        elif step["op"] == "attached":  # wait until the worker's and the scheduler's links are attached
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            t_end = time.monotonic() + step.get("timeout", 60)
            conns = [get_kv_transfer_group(), llm.llm_engine.engine_core.engine_core.scheduler.connector]
            rec["ok"] = all(c.wait_attached(max(0.0, t_end - time.monotonic())) for c in conns)
            # "worker_attaches": n also waits until the worker's link has attached n times: after its
            # rankd restarted, the link may still read attached until a health check sees the new one
            while rec["ok"] and conns[0].stats["attaches"] < step.get("worker_attaches", 0):
                if time.monotonic() > t_end:
                    rec["ok"] = False
                    break
                time.sleep(0.02)
        elif step["op"] == "hook":
            with open(step["file"] + ".ready", "w") as f:
                f.write("ready")
            deadline = time.monotonic() + step.get("timeout", 120)
            while not os.path.exists(step["file"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            rec["ok"] = os.path.exists(step["file"])
        rec["s"] = round(time.monotonic() - t, 2)
        rec.update(_stats(llm))
        records.append(rec)
        with open(sys.argv[2], "w") as f:
            json.dump(records, f, indent=1)
    del llm


if __name__ == "__main__":
    main()
