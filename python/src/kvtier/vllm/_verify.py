"""Engine-side verification (kvtier_verify_on_engine, issue 28): after a
restore's verdict confirms chunks and before the load is reported to vLLM,
the worker sums the pages the restore placed into vLLM's own KV tensors,
on the engine's device (kvtier._kvsum_torch), and compares each object's
sum with the one the coordinator recorded at store time (the plan's
RetrieveItem.sum). A chunk whose pages do not match is failed as a failed
verdict fails it: its blocks go to the load errors (or, with several
groups, the request to failed_recving) and vLLM recomputes it.

The rankd that placed the pages is then out of the trust base: a rankd
that reports OK (even with the right sum) for pages it did not place, or
placed wrong, fails its chunks here. What is still trusted is the sum the
coordinator recorded when the object was stored, the scheduler that hands
the plan to the worker, and the engine's own process and device.

The sums are computed off vLLM's step (C11): in the load's future, once its
verdict is in, on a thread of the client's loop and, on CUDA, a stream of
its own (check_off_step); the step only applies what was found (apply),
counting and logging as before. The pages read belong to a request that
waits for this load (vLLM writes them only after get_finished reports it)
or are full blocks of vLLM's prefix cache, which nothing writes while the
request holds them, so the read never races a forward's writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier import _kvsum_torch, client_plan, wire
from kvtier.vllm._state import LoadSpec, _LoadResult
from kvtier.vllm.spec import GroupLayers

if TYPE_CHECKING:
    from kvtier.vllm._worker import _WorkerSide

log = logging.getLogger("kvtier.vllm")


def engine_pools(layers: list[GroupLayers], kv_caches: dict[str, Any]) -> list[list[Any]]:
    """Each group's pools in kvtier's pool order, as (num_blocks, page)
    uint8 views of vLLM's tensors: a layer's tensor, or under kv_split its
    K half then its V half, or for a Mamba layer its whole pages from the
    first block's (the rows of its states a page apart, as the worker
    registers them). The tensors have passed the layout check."""
    out: list[list[Any]] = []
    for gl in layers:
        pools: list[Any] = []
        for name in gl.layer_names:
            t = kv_caches[name]
            if gl.recurrent:
                import torch

                pools.append(t.view(torch.uint8).as_strided((int(t.shape[0]), gl.page_bytes), (gl.page_bytes, 1)))
            elif gl.kv_split:
                pools += [_kvsum_torch.pool_pages(t[0], gl.page_bytes // 2),
                          _kvsum_torch.pool_pages(t[1], gl.page_bytes // 2)]
            else:
                pools.append(_kvsum_torch.pool_pages(t, gl.page_bytes))
        out.append(pools)
    return out


# Off the step the check's temporaries share the device with a forward
# running meanwhile, whose memory vLLM sized without them: batches of at
# most this many bytes keep what the check lends small (on the step, between
# forwards, _kvsum_torch's default 256 MiB).
OFF_STEP_BATCH_BYTES = 64 << 20


def mismatches(conn: _WorkerSide, load: LoadSpec, items: list[wire.RetrieveItem],
               max_batch_bytes: int = 256 << 20) -> list[tuple[int, int, int, int]]:
    """(chunk, group, sum of the placed pages, recorded sum) of every item
    whose pages do not sum to the recorded sum; an item without a recorded
    sum (0) is never confirmed."""
    import torch

    bad: list[tuple[int, int, int, int]] = []
    for gi, pools in enumerate(conn._engine_pools):
        its = [it for it in items if it.group == gi]
        if not its:
            continue
        bpc = conn.resolved.blocks_per_chunk(gi)
        ids = []
        for it in its:
            ch = load.first_chunk + it.chunk
            ids.append(load.block_ids[gi][ch * bpc:(ch + 1) * bpc])
        blocks = torch.tensor(ids, dtype=torch.int64, device=pools[0].device)
        sums = _kvsum_torch.object_sums(pools, blocks, max_batch_bytes)
        bad += [(it.chunk, gi, got, it.sum) for it, got in zip(its, sums, strict=True) if got != it.sum or not it.sum]
    return bad


@dataclass
class Checked(_LoadResult):
    """A load's result with what the check of its confirmed chunks found:
    bad (as mismatches returns it), or error when the check could not run.
    check_off_step makes it in the load's future; apply reads it on the
    step."""

    bad: list[tuple[int, int, int, int]] = field(default_factory=list)
    error: str = ""


def _check(conn: _WorkerSide, load: LoadSpec, res: _LoadResult, max_batch_bytes: int) -> _LoadResult:
    """res as Checked when there is something to check: chunks confirmed
    and items of this rank; res itself otherwise. Touches no counter."""
    raw = load.items.get(str(conn._rank))
    if res.loaded <= 0 or not raw:
        return res
    try:
        items = client_plan.PlanItems.from_bytes(raw).items()
        upto = min(res.loaded, load.chunks)  # what vLLM is told is loaded
        bad = mismatches(conn, load, [it for it in items if it.chunk < upto], max_batch_bytes)
    except Exception as e:  # fail closed (apply): nothing unchecked is reported loaded
        return Checked(res.loaded, res.bad_bytes_chunks, res.problem, error=str(e) or type(e).__name__)
    return Checked(res.loaded, res.bad_bytes_chunks, res.problem, bad=bad)


def check_off_step(conn: _WorkerSide, load: LoadSpec, res: _LoadResult) -> _LoadResult:
    """The check of a load whose verdict is in, run in its future on a
    thread that is not vLLM's: on CUDA on a stream of its own (the work
    waits for nothing of vLLM's streams and vLLM's wait for nothing of it;
    reading the sums back synchronizes this stream only), on the CPU
    plainly."""
    pools = conn._engine_pools[0] if conn._engine_pools else []
    dev = getattr(pools[0], "device", None) if pools else None
    if dev is None or getattr(dev, "type", "") != "cuda":
        return _check(conn, load, res, OFF_STEP_BATCH_BYTES)
    import torch

    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(stream):
            return _check(conn, load, res, OFF_STEP_BATCH_BYTES)


def verify_load(conn: _WorkerSide, load: LoadSpec, res: _LoadResult) -> _LoadResult:
    """res, or with fewer chunks loaded when this rank's pages of a
    confirmed chunk do not match the recorded sums (the chunks from the
    first bad one on are recomputed). A verification that cannot run
    fails every chunk: the option asks not to trust unchecked pages. It
    applies the check the load's future made (check_off_step), or, for a
    result that did not come through it with chunks to check, makes it
    here on the step."""
    if not isinstance(res, Checked):
        res = _check(conn, load, res, 256 << 20)
    return apply(conn, load, res)


def apply(conn: _WorkerSide, load: LoadSpec, res: _LoadResult) -> _LoadResult:
    """What a check found, counted and logged, on vLLM's step: res (as a
    plain _LoadResult) when its chunks matched or there was nothing to
    check, else with fewer chunks loaded."""
    if not isinstance(res, Checked):
        return res
    plain = _LoadResult(res.loaded, res.bad_bytes_chunks, res.problem)
    if res.error:
        conn.stats["engine_verify_failures"] += res.loaded
        log.warning("kvtier restore %s for %s: engine-side verification failed, recomputing: %s",
                    load.restore_id, load.req_id, res.error)
        return _LoadResult(0, res.bad_bytes_chunks, f"engine verify: {res.error}")
    bad = res.bad
    if not bad:
        return plain
    chunks = {c for c, _, _, _ in bad}
    conn.stats["engine_verify_failures"] += len(chunks)
    c, g, got, want = min(bad)
    problem = (f"engine verify: chunk {c} group {g} on {conn._rank}: the placed pages sum to {got:#018x}, "
               f"the coordinator recorded {want:#018x}")
    log.warning("kvtier restore %s for %s: %s (%d chunks refused)", load.restore_id, load.req_id, problem, len(chunks))
    return _LoadResult(min(chunks), res.bad_bytes_chunks + len(chunks), problem)
