"""What a restore costs through the Python client besides its bytes
(issue 25.4: the fixed cost <= 2 ms), on the host backend: a coordinator
and TP rankds as real processes, the engine's pools host-backend memory,
pages of 1 KiB so that the copies are a small part. It stores C chunks
once, then restores the first n of them again and again (n in NS),
timing each phase from the engine's side: lookup, restore.begin (the
coordinator's plan), the ranks' retrieves (request to reply, all ranks
at once) and restore.wait (the verdict, sent beside the retrieves), and
the whole restore. Prints the medians; a line fit of the whole over n
splits it into a fixed part and a part per chunk. Not part of make test:

    cd python && .venv/bin/pytest -s tests/bench_restore_cost.py

Numbers from this VM are the host backend's and this machine's, labelled
so in BENCHMARKS.md; the GPU's are measured by gpu-bench.sh."""

from __future__ import annotations

import asyncio
import os
import pathlib
import statistics
import time
from typing import Any

import pytest

from cluster import HOST_UUID, Cluster, eventually, running
from kvtier import client, cuda, dcp, wire

pytestmark = pytest.mark.integration

TP = int(os.environ.get("KVTIER_BENCH_TP", "2"))
NS = [int(x) for x in os.environ.get("KVTIER_BENCH_CHUNKS", "1,8,32,128").split(",")]
REPS = int(os.environ.get("KVTIER_BENCH_REPS", "30"))
BLOCKS_PER_CHUNK = 1
SPEC = dcp.Spec(
    model="bench-restore-cost", cache_salt="b",
    layout=dcp.Layout(tp=TP, dcp=1, interleave=1, pp=1),
    groups=[dcp.Group(name="attn", kind=dcp.Kind.ATTENTION, block_size=16, layers=2,
                      semantic_bytes=1024, page_bytes=1024, stride_bytes=1024, kv_format="bf16")],
    chunk_tokens=16,
)


@pytest.fixture
def cluster(binaries: pathlib.Path, tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    yield from running(Cluster(binaries, tmp_path, TP), request)


def test_restore_cost(cluster: Cluster) -> None:
    r = SPEC.resolve()
    n_max = max(NS)
    blocks = 2 * n_max + 2
    tokens = list(range(n_max * SPEC.chunk_tokens + 1))
    hashes = r.chunk_hashes(tokens)
    dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
    layers = r.geometry[0].group.layers
    pool = r.geometry[0].pool_bytes(blocks)
    mems = [dev.alloc(pool * layers) for _ in range(TP)]
    with client.SyncClient(cluster.connect_options(timeout=20)) as c:
        ns = eventually("spec registered", lambda: c.register_spec(SPEC))
        ranks = [wire.Rank("engine0", t) for t in range(TP)]
        for rk in ranks:
            eventually(f"rankd {rk} accepts", lambda rk=rk: c.status(rk).accepting or (_ for _ in ()).throw(
                AssertionError("not accepting yet")))
        cluster.wait_resynced()
        sessions = {str(rk): c.register(rk, SPEC, HOST_UUID, [
            wire.PoolRegistration(0, layer, mems[rk.tp_rank].export(layer * pool, pool)) for layer in range(layers)])
            for rk in ranks}
        for m in mems:
            m.view[:] = os.urandom(len(m.view))
        futures = []
        for rk in ranks:
            ev = dev.new_event()
            ev.record()
            futures.append(sessions[str(rk)].store_async(
                "bench", [wire.ChunkBlocks(hashes[i], [[i]]) for i in range(n_max)], ev.export()))
        for f in futures:
            rep = f.result(60)
            assert rep.stored == n_max and not rep.failed, rep
        eventually("lookup covers the prompt", lambda: c.lookup(ns, hashes, instance="engine0").prefix == n_max
                   or (_ for _ in ()).throw(AssertionError("not yet")))

        time.sleep(float(os.environ.get("KVTIER_BENCH_SETTLE_S", "3")))  # the store's write-behind to L2 ends first
        aio = c.aio
        asess = {k: s.aio for k, s in sessions.items()}

        async def once(n: int, packed: bool) -> dict[str, float]:
            t0 = time.perf_counter()
            if packed:  # the begin is the lookup (RestoreBeginRequest.Lookup), as in the vLLM connector
                t1 = t0
                plan = await aio.restore_begin_packed(ns, hashes[:n], instance="engine0", deadline_ms=10000,
                                                      lookup=True)
            else:
                await aio.lookup(ns, hashes[:n], instance="engine0")
                t1 = time.perf_counter()
                plan = await aio.restore_begin(ns, hashes[:n], instance="engine0", deadline_ms=10000)
            t2 = time.perf_counter()
            assert plan.prefix == n, plan
            wait = asyncio.ensure_future(aio.restore_wait(plan.restore_id, instance="engine0"))
            block_ids = [[n_max + 1 + c for c in range(n)]]

            async def one(name: str, items: Any) -> None:
                s = asess[name]
                if packed:  # as the vLLM connector's worker does
                    await s.retrieve_packed(items, plan.restore_id, block_ids, [BLOCKS_PER_CHUNK])
                    return
                for it in items:
                    it.blocks = [n_max + 1 + it.chunk]
                rep = await s.retrieve(items, plan.restore_id)
                assert all(x.ok for x in rep.results), rep

            await asyncio.gather(*(one(k, v) for k, v in plan.ranks.items()))
            t3 = time.perf_counter()
            v = await wait
            t4 = time.perf_counter()
            assert v.state == wire.VERDICT_COMPLETE, v
            return {"lookup": t1 - t0, "begin": t2 - t1, "retrieve": t3 - t2, "verdict": t4 - t3,
                    "restore": t4 - t1, "all": t4 - t0}

        # The two paths alternate, sample by sample, so that neither gets
        # the quieter moments of the machine.
        by_path: dict[bool, list[tuple[int, dict[str, float]]]] = {False: [], True: []}
        for n in NS:
            samples: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for i in range(REPS + 2):
                for packed in (False, True):
                    s = c.run(once(n, packed), 30)
                    if i >= 2:
                        samples[packed].append(s)
            for packed in (False, True):
                by_path[packed].append((n, {k: 1000 * statistics.median(x[k] for x in samples[packed])
                                            for k in samples[packed][0]}))
        for packed in (False, True):
            rows = by_path[packed]
            how = ("packed items, the begin as the lookup (restore_begin_packed(lookup=True), retrieve_packed: the "
                   "vLLM connector's path)" if packed else "RetrieveItem objects (lookup, restore_begin, retrieve)")
            print(f"\nrestore through the Python client, {how}, host backend, TP {TP}, 1 KiB pages x {layers} "
                  f"layers, median of {REPS} (ms):")
            print("| chunks | lookup | restore.begin | retrieves | verdict after them | restore (begin to verdict) "
                  "| lookup to verdict |")
            print("|---|---|---|---|---|---|---|")
            for n, m in rows:
                print(f"| {n} | {m['lookup']:.2f} | {m['begin']:.2f} | {m['retrieve']:.2f} | {m['verdict']:.2f} | "
                      f"{m['restore']:.2f} | {m['all']:.2f} |")
            xs, ys = [n for n, _ in rows], [m["restore"] for _, m in rows]
            if len(xs) > 1:
                slope, icept = statistics.linear_regression(xs, ys)
                print(f"fit: restore = {icept:.2f} ms + {1000 * slope:.1f} us per chunk")
    for m in mems:
        m.release()
