"""KvtierConnector end to end against real daemons (coordinator + two
rankds, host backend): one scheduler-side and two worker-side connectors
in this process, driven with vLLM's call sequence on fake vLLM request and
scheduler-output objects, pools in host-backend shared memory. This is not
vLLM: it runs the connector's code against real kvtier processes."""

from __future__ import annotations

import concurrent.futures
import hashlib
import pathlib
import random

import pytest

import fakes
from cluster import HOST_UUID, Cluster, eventually, running
from kvtier import client, cuda, dcp, wire
from kvtier.vllm import KvtierConnector
from kvtier.vllm.connector import KVConnectorRole

pytestmark = pytest.mark.integration

TP = 2
NUM_BLOCKS = 32
LAYERS = 2


@pytest.fixture
def cluster(binaries: pathlib.Path, tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    yield from running(Cluster(binaries, tmp_path, TP), request)


class HostConnector(KvtierConnector):
    """The connector with its two device seams on the host backend."""

    tp_rank = 0
    dev: cuda.HostDevice

    def _tp_rank(self) -> int:
        return self.tp_rank

    def _pool_handles(self, gi, layer, tensor):
        self._check_layout(gi, layer, tensor)
        return list(tensor.handle) if isinstance(tensor.handle, list) else [tensor.handle]

    def _new_event(self):
        ev = self.dev.new_event()
        ev.record()
        return ev, ev.export()


class Worker:
    def __init__(self, cluster: Cluster, tp_rank: int, kv_cfg, extra, par: dict | None = None) -> None:
        self.dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
        spec = kv_cfg.kv_cache_groups[0].kv_cache_spec
        self.page = spec.page_size_bytes
        self.mem = self.dev.alloc(LAYERS * NUM_BLOCKS * self.page)
        self.conn = connector(KVConnectorRole.WORKER, kv_cfg, extra, tp_rank, self.dev, par)
        self.tp = tp_rank
        self.split = extra.get("kvtier_pool_layout") == "kv_split"
        self.mla = type(spec).__name__ == "MLAAttentionSpec"
        caches = {}
        size = NUM_BLOCKS * self.page
        half = self.page // 2
        for li, name in enumerate(kv_cfg.kv_cache_groups[0].layer_names):
            if self.split:  # FlashAttention: (2, num_blocks, bs, heads, dim), K then V
                caches[name] = fakes.Tensor((2, NUM_BLOCKS, 16, 2, 8), (NUM_BLOCKS * half // 2, half // 2, 16, 8, 1),
                                            2, [self.mem.export(li * size, size // 2),
                                                self.mem.export(li * size + size // 2, size // 2)])
            elif self.mla:  # MLA: (num_blocks, bs, latent)
                caches[name] = fakes.Tensor((NUM_BLOCKS, 16, 32), (512, 32, 1), 2, self.mem.export(li * size, size))
            else:  # FlashInfer: (num_blocks, 2, bs, heads, dim)
                caches[name] = fakes.Tensor((NUM_BLOCKS, 2, 16, 2, 8), (half, 256, 16, 8, 1), 2,
                                            self.mem.export(li * size, size))
        self.conn.register_kv_caches(caches)
        assert self.conn.wait_attached(30), f"worker {tp_rank} did not attach: {self.conn._link.why}"

    def spans(self, layer: int, block: int) -> list[tuple[int, int]]:
        """Where a layer's page of a block lives: one span, or K and V."""
        base, half = layer * NUM_BLOCKS * self.page, self.page // 2
        if self.split:
            return [(base + block * half, half), (base + NUM_BLOCKS * half + block * half, half)]
        return [(base + block * self.page, self.page)]

    def forward(self, tokens: list[int], blocks: list[int], upto: int) -> None:
        """'Computes' the KV of tokens [0, upto): page content depends on
        the rank, layer, and the tokens of the block and all before it."""
        for bi in range(upto // 16):
            for layer in range(LAYERS):
                # MLA's latent cache is the same on every TP rank
                data = kv_bytes(0 if self.mla else self.tp, layer, tokens[:(bi + 1) * 16], self.page)
                pos = 0
                for o, n in self.spans(layer, blocks[bi]):
                    self.mem.view[o:o + n] = data[pos:pos + n]
                    pos += n

    def page_at(self, layer: int, block: int) -> bytes:
        return b"".join(bytes(self.mem.view[o:o + n]) for o, n in self.spans(layer, block))


def kv_bytes(tp: int, layer: int, prefix: list[int], n: int) -> bytes:
    seed = hashlib.sha256(f"{tp}/{layer}/{prefix}".encode()).digest()
    return random.Random(seed).randbytes(n)


def connector(role, kv_cfg, extra, tp_rank=0, dev=None, par: dict | None = None) -> HostConnector:
    cls = type("C", (HostConnector,), {"tp_rank": tp_rank, "dev": dev})
    extra = dict(extra)
    extra.setdefault("kvtier_chunk_tokens", 16 * int((par or {}).get("decode_context_parallel_size", 1)))
    extra.setdefault("kvtier_load_async", False)  # run_step reads each step's load errors at once
    vc = fakes.vllm_config(TP, **extra)
    for k, v in (par or {}).items():
        setattr(vc.parallel_config, k, v)
    conn = cls(vc, role, kv_cfg)
    if role == KVConnectorRole.SCHEDULER:
        assert conn.wait_attached(30), f"the scheduler did not attach: {conn._link.why}"
    return conn


def reattached(workers, n: int) -> None:
    """A restarted rankd forgot the registrations: each worker's link sees
    the new incarnation (health check, 1 s) and registers again in the
    background; until it has, a load on that rank fails (a recompute)."""

    def ok() -> bool:
        for w in workers:
            if w.conn.stats["reregistered"] < n or not w.conn.wait_attached(0.05):
                raise AssertionError(f"worker {w.tp}: registered again {w.conn.stats['reregistered']} times, "
                                     f"link {w.conn._link.state}: {w.conn._link.why}")
        return True

    eventually(f"every worker registered again ({n})", ok, timeout=30)


def run_step(sched, workers, out):
    """One engine step: the scheduler's metadata goes to every worker, and
    the workers (separate processes under vLLM, threads here) load at once:
    each waits for the verdict, which needs every rank's report."""
    meta = sched.build_connector_meta(out)
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as ex:
        for w in workers:
            w.conn.bind_connector_metadata(meta)
        list(ex.map(lambda w: w.conn.start_load_kv(None), workers))
    return meta


def finish_saves(workers, req_ids: set[str]) -> None:
    """vLLM passes finished request ids once, then polls get_finished."""
    pending = {w.tp: set(req_ids) for w in workers}
    first = {w.tp: True for w in workers}

    def reap():
        for w in workers:
            done, _ = w.conn.get_finished(set(req_ids) if first[w.tp] else set())
            first[w.tp] = False
            pending[w.tp] -= done or set()
        if any(pending.values()):
            raise AssertionError(f"stores still in flight: {pending}")

    eventually("every worker finished the stores", reap)


@pytest.mark.parametrize("layout", ["block_major", "kv_split", "mla"])
def test_connector_store_reset_restore_and_l2_after_restart(cluster: Cluster, layout: str) -> None:
    """block_major: FlashInfer pools; kv_split: FlashAttention's; mla: an MLA
    group, stored by TP rank 0 only and read back by both ranks (rank 1 from
    rank 0's L2 object)."""
    mla = layout == "mla"
    extra = dict(kvtier_nats=cluster.nats_url, kvtier_device="host", kvtier_instance="engine0",
                 kvtier_creds_dir=str(cluster.creds),
                 kvtier_lookup_wait_s=2.0, kvtier_timeout_s=20,
                 kvtier_pool_layout="block_major" if mla else layout)
    kv_cfg = fakes.attention_config(num_blocks=NUM_BLOCKS, layers=LAYERS)
    if mla:
        kv_cfg.kv_cache_groups[0].kv_cache_spec = fakes.MLAAttentionSpec(block_size=16, num_kv_heads=1,
                                                                         head_size=32, dtype=fakes.BF16)
    sched = connector(KVConnectorRole.SCHEDULER, kv_cfg, extra)
    wait_ranks(cluster)
    workers = [Worker(cluster, t, kv_cfg, extra) for t in range(TP)]
    rng = random.Random(3)
    prompt = [rng.randrange(32000) for _ in range(16 * 4 + 3)]  # 4 full chunks + 3 tokens

    # 1. Cold: nothing to load; the prefill stores every full chunk.
    req = fakes.Request("cold", prompt)
    assert eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0))) == (0, False)
    blocks_a = [3, 9, 4, 17, 11]
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks_a,)), 0)
    for w in workers:
        w.forward(prompt, blocks_a, len(prompt))
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData("cold", prompt, (blocks_a,), 0)],
                                num_scheduled_tokens={"cold": len(prompt)})
    meta = run_step(sched, workers, out)
    assert [len(s.chunks) for s in meta.saves] == [4]
    for w in workers:
        w.conn.wait_for_save()
    assert sched.request_finished(req, blocks_a) == (True, None)
    finish_saves(workers, {"cold"})
    assert [w.conn.stats["stored_objects"] for w in workers] == ([4, 0] if mla else [4] * TP)
    assert all(w.conn.stats["store_failures"] == 0 for w in workers)
    originals = {(w.tp, layer, bi): w.page_at(layer, blocks_a[bi]) for w in workers
                 for layer in range(LAYERS) for bi in range(4)}

    # 2. reset_prefix_cache: pages wiped; the same prompt loads its 4 full
    # chunks into other blocks (vLLM computes the 3 trailing tokens).
    for w in workers:
        w.mem.view[:] = bytes(len(w.mem.view))
    with client.SyncClient(cluster.connect_options()) as c:
        hashes = sched.resolved.chunk_hashes(prompt)
        eventually("index shows the prompt",
                   lambda: _prefix(c.lookup(sched.resolved.namespace, hashes, instance="engine0"), 4))
    assert restore_once(sched, workers, prompt, "warm", [20, 21, 22, 23, 24], originals) == 64

    # 3. Restart the rankds (L1 lost, registrations forgotten) without
    # restarting the engine: the workers see the new incarnation before the
    # step's loads, register again, and the prompt loads from L2.
    restart_ranks(cluster)
    reattached(workers, 1)
    for w in workers:
        w.mem.view[:] = bytes(len(w.mem.view))
    with client.SyncClient(cluster.connect_options()) as c:
        eventually("index shows the L2 copies",
                   lambda: _prefix(c.lookup(sched.resolved.namespace, hashes, instance="engine0"), 4), timeout=60)
    assert restore_once(sched, workers, prompt, "after-restart", [5, 6, 7, 8, 9], originals) == 64
    assert [w.conn.stats["reregistered"] for w in workers] == [1] * TP

    # 3b. Restart the coordinator (index in bbolt): clients reconnect, the
    # same prompt still loads.
    cluster.coord.stop()
    cluster.start_coordinator()
    wait_ranks(cluster)  # the rankds' NATS connections are back
    with client.SyncClient(cluster.connect_options()) as c:
        eventually("index answers after the coordinator restart",
                   lambda: _prefix(c.lookup(sched.resolved.namespace, hashes, instance="engine0"), 4), timeout=60)
    for w in workers:
        w.mem.view[:] = bytes(len(w.mem.view))
    assert restore_once(sched, workers, prompt, "after-coord-restart", [25, 26, 27, 28, 29], originals) == 64

    # 4. Restart the rankds (L1 empty again), then corrupt chunk 1's L2
    # object of rank 1: the verdict fails; blocks of chunks 1..3 go to load
    # errors (vLLM recomputes them), chunk 0 is byte-exact, and nothing
    # garbled counts as loaded.
    restart_ranks(cluster)
    reattached(workers, 2)
    for w in workers:
        w.mem.view[:] = bytes(len(w.mem.view))
    with client.SyncClient(cluster.connect_options()) as c:
        eventually("index shows the L2 copies",
                   lambda: _prefix(c.lookup(sched.resolved.namespace, hashes, instance="engine0"), 4), timeout=60)
    key = dcp.Key(sched.resolved.namespace, hashes[1], 0 if mla else 1, 0)
    path = cluster.l2 / str(sched.resolved.namespace) / (str(key) + ".kvo")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    blocks_d = [12, 13, 14, 15, 16]
    req = fakes.Request("corrupt", prompt)
    n, _ = eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0)))
    assert n == 64
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks_d,)), n)
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData("corrupt", prompt, (blocks_d,), n)],
                                num_scheduled_tokens={"corrupt": len(prompt) - n})
    run_step(sched, workers, out)
    errs = [w.conn.get_block_ids_with_load_errors() for w in workers]
    assert errs == [{13, 14, 15}, {13, 14, 15}], errs
    for w in workers:
        assert w.conn.stats["restore_failures"] == 1
        assert w.conn.stats["reregistered"] == 2
        for layer in range(LAYERS):
            assert w.page_at(layer, blocks_d[0]) == originals[(w.tp, layer, 0)]
    sched.request_finished(req, blocks_d)
    shutdown(sched, workers)


def shutdown(sched, workers) -> None:
    """Shuts the workers' connectors down and frees their memory, then the
    scheduler's connector."""
    for w in workers:
        w.conn.shutdown()
        w.mem.release()
    sched.shutdown()


DCP_BS = 16  # a rank's block size; vLLM's scheduler blocks hold DCP_BS * 2 tokens
ROW = 2 * 8 * 2  # one token of one K (or V) page half: 2 heads x 8 dims x bf16


def dcp_forward(w: Worker, lay: dcp.Layout, tokens: list[int], blocks: list[int], upto: int) -> None:
    """'Computes' tokens [0, upto) as vLLM does under DCP: each position's
    K and V row go to the rank and slot vLLM's slot mapping gives
    (dcp.Layout.local_slot, held to vLLM's kernel by test_vllm_dcp), in the
    FlashInfer page (K rows, then V rows); a row depends on the rank, the
    layer and the tokens up to it."""
    for pos in range(upto):
        r, slot = lay.local_slot(pos, DCP_BS, blocks)
        if r != lay.dcp_rank(w.tp):
            continue
        for layer in range(LAYERS):
            kv = kv_bytes(w.tp, layer, tokens[:pos + 1], 2 * ROW)
            base = layer * NUM_BLOCKS * w.page + (slot // DCP_BS) * w.page + (slot % DCP_BS) * ROW
            w.mem.view[base:base + ROW] = kv[:ROW]
            w.mem.view[base + w.page // 2:base + w.page // 2 + ROW] = kv[ROW:]


def test_connector_dcp2_stores_and_restores_pages_dealt_as_vllm_deals_them(cluster: Cluster) -> None:
    """TP2 with DCP 2, interleave 4: every TP rank holds its own tokens of
    each scheduler block (32 tokens, block ids shared by both ranks); each
    stores its own pages of every chunk, and a restore into other block ids
    puts back, on each rank, exactly the KV rows of its tokens."""
    par = dict(decode_context_parallel_size=2, cp_kv_cache_interleave_size=4)
    extra = dict(kvtier_nats=cluster.nats_url, kvtier_device="host", kvtier_instance="engine0",
                 kvtier_creds_dir=str(cluster.creds), kvtier_lookup_wait_s=2.0, kvtier_timeout_s=20)
    kv_cfg = fakes.attention_config(num_blocks=NUM_BLOCKS, layers=LAYERS, block_size=DCP_BS)
    sched = connector(KVConnectorRole.SCHEDULER, kv_cfg, extra, par=par)
    assert (sched.chunk, sched.spec.layout.dcp, sched.spec.layout.interleave) == (32, 2, 4)
    lay = sched.spec.layout
    wait_ranks(cluster)
    workers = [Worker(cluster, t, kv_cfg, extra, par) for t in range(TP)]
    rng = random.Random(5)
    prompt = [rng.randrange(32000) for _ in range(32 * 4 + 3)]  # 4 full chunks + 3 tokens

    req = fakes.Request("dcp-cold", prompt)
    assert eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0))) == (0, False)
    blocks_a = [3, 9, 4, 17, 11]
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks_a,)), 0)
    for w in workers:
        dcp_forward(w, lay, prompt, blocks_a, len(prompt))
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData("dcp-cold", prompt, (blocks_a,), 0)],
                                num_scheduled_tokens={"dcp-cold": len(prompt)})
    meta = run_step(sched, workers, out)
    assert [[c[1] for c in s.chunks] for s in meta.saves] == [[[[3]], [[9]], [[4]], [[17]]]]
    for w in workers:
        w.conn.wait_for_save()
    assert sched.request_finished(req, blocks_a) == (True, None)
    finish_saves(workers, {"dcp-cold"})
    assert [w.conn.stats["stored_objects"] for w in workers] == [4, 4]
    originals = {(w.tp, layer, bi): w.page_at(layer, blocks_a[bi]) for w in workers
                 for layer in range(LAYERS) for bi in range(4)}
    assert originals[(0, 0, 0)] != originals[(1, 0, 0)]  # the ranks hold different tokens

    for w in workers:
        w.mem.view[:] = bytes(len(w.mem.view))
    with client.SyncClient(cluster.connect_options()) as c:
        hashes = sched.resolved.chunk_hashes(prompt)
        eventually("index shows the prompt",
                   lambda: _prefix(c.lookup(sched.resolved.namespace, hashes, instance="engine0"), 4))
    blocks_b = [20, 21, 22, 23, 24]
    req = fakes.Request("dcp-warm", prompt)
    n, load_async = eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0)))
    assert (n, load_async) == (128, False)
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks_b,)), n)
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData("dcp-warm", prompt, (blocks_b,), n)],
                                num_scheduled_tokens={"dcp-warm": len(prompt) - n})
    meta = run_step(sched, workers, out)
    assert len(meta.loads) == 1 and meta.loads[0].planned == 4 and meta.saves == []
    for w in workers:
        assert w.conn.get_block_ids_with_load_errors() == set()
        assert w.conn.stats["loaded_tokens"] == 128
        for layer in range(LAYERS):
            for bi in range(4):
                assert w.page_at(layer, blocks_b[bi]) == originals[(w.tp, layer, bi)], (w.tp, layer, bi)
            assert w.page_at(layer, blocks_b[4]) == bytes(w.page)
    check_dcp_rows(workers, lay, prompt, blocks_b, range(128))
    sched.request_finished(req, blocks_b)
    shutdown(sched, workers)


def check_dcp_rows(workers: list[Worker], lay: dcp.Layout, tokens: list[int], blocks: list[int],
                   positions: range) -> None:
    """Reads tokens' rows back through vLLM's mapping at blocks: every
    position's K and V rows are the ones dcp_forward computed for it, on
    the rank that owns it."""
    for pos in positions:
        r, slot = lay.local_slot(pos, DCP_BS, blocks)
        w = workers[r]
        for layer in range(LAYERS):
            kv = kv_bytes(w.tp, layer, tokens[:pos + 1], 2 * ROW)
            base = layer * NUM_BLOCKS * w.page + (slot // DCP_BS) * w.page + (slot % DCP_BS) * ROW
            assert bytes(w.mem.view[base:base + ROW]) == kv[:ROW], (pos, layer)
            assert bytes(w.mem.view[base + w.page // 2:base + w.page // 2 + ROW]) == kv[ROW:], (pos, layer)


def restart_ranks(cluster: Cluster) -> None:
    for r in range(TP):
        cluster.ranks[r].stop()
        cluster.start_rank(r)
    wait_ranks(cluster)


def wait_ranks(cluster: Cluster) -> None:
    with client.SyncClient(cluster.connect_options()) as c:
        for r in range(TP):
            rk = wire.Rank("engine0", r)
            eventually(f"rankd {rk} accepts again", lambda rk=rk: _true(c.status(rk).accepting))


def _true(v: bool) -> bool:
    if not v:
        raise AssertionError("not yet")
    return v


def load_attempt(sched, workers, prompt, req_id, blocks) -> list[set[int]]:
    req = fakes.Request(req_id, prompt)
    n, _ = eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0)))
    assert n == 64
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks,)), n)
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData(req_id, prompt, (blocks,), n)],
                                num_scheduled_tokens={req_id: len(prompt) - n})
    run_step(sched, workers, out)
    sched.request_finished(req, blocks)
    return [w.conn.get_block_ids_with_load_errors() for w in workers]


def restore_once(sched, workers, prompt, req_id, blocks, originals) -> int:
    req = fakes.Request(req_id, prompt)
    n, load_async = eventually("lookup answers", lambda: _answered(sched.get_num_new_matched_tokens(req, 0)))
    assert (n, load_async) == (64, False)
    sched.update_state_after_alloc(req, fakes.KVCacheBlocks((blocks,)), n)
    out = fakes.SchedulerOutput(scheduled_new_reqs=[fakes.NewRequestData(req_id, prompt, (blocks,), n)],
                                num_scheduled_tokens={req_id: len(prompt) - n})
    meta = run_step(sched, workers, out)
    assert len(meta.loads) == 1 and meta.loads[0].planned == 4, meta.loads
    assert meta.saves == []  # loaded chunks are not stored again
    for w in workers:
        assert w.conn.get_block_ids_with_load_errors() == set()
        for layer in range(LAYERS):
            for bi in range(4):
                assert w.page_at(layer, blocks[bi]) == originals[(w.tp, layer, bi)], (w.tp, layer, bi)
            assert w.page_at(layer, blocks[4]) == bytes(w.page)  # the partial block: computed by vLLM
    for w in workers:
        w.conn.wait_for_save()
    sched.request_finished(req, blocks)
    finish_saves(workers, {req_id} if meta.saves else set())
    return sum(ld.planned for ld in meta.loads) * 16


def _answered(r):
    if r[0] is None:
        raise AssertionError("not yet")
    return r


def _prefix(lk: wire.LookupReply, n: int) -> wire.LookupReply:
    if lk.prefix != n or lk.not_alive:
        raise AssertionError(f"lookup prefix {lk.prefix} of {n}, not alive {lk.not_alive} {lk.reason}")
    return lk
