"""Several KV cache groups (vLLM's hybrid allocator), PP and the group kinds
the connector refuses, against fakes of vLLM's objects and of kvtier's
client (issue 27.1, 27.2). Real vLLM with a hybrid model:
test_vllm_real.py."""

from __future__ import annotations

import pytest
from test_vllm_connector import make, plan_for, tokens

import fakes
from kvtier import client_plan, cuda, dcp, errors, wire
from kvtier.vllm import KvtierConnectorMetadata, LoadSpec, SaveSpec, spec_from_vllm
from kvtier.vllm.connector import KVConnectorRole

BS = 16


def hybrid_config(window: int = 48, num_blocks: int = 64) -> fakes.KVCacheConfig:
    """Gemma-2-like: group 0 sliding window (2 layers), group 1 full
    attention (1 layer of another page size)."""
    sw = fakes.SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=fakes.BF16, sliding_window=window)
    full = fakes.FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=8, dtype=fakes.BF16)
    return fakes.KVCacheConfig(num_blocks, [], [fakes.KVCacheGroupSpec(["l0", "l2"], sw),
                                                fakes.KVCacheGroupSpec(["l1"], full)])


def test_spec_every_group_with_its_own_page_geometry():
    spec, layers = spec_from_vllm(hybrid_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=BS)
    r = spec.resolve()
    assert [(g.kind, g.layers, g.page_bytes) for g in spec.groups] == [
        (dcp.Kind.SLIDING_WINDOW, 2, 1024), (dcp.Kind.ATTENTION, 1, 2048)]
    assert [gl.sliding_window for gl in layers] == [48, 0]
    assert [r.blocks_per_chunk(g) for g in range(2)] == [1, 1]
    one, _ = spec_from_vllm(fakes.attention_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=BS)
    assert one.resolve().namespace != r.namespace  # another model's layout: other objects


def test_spec_fails_closed_on_group_kinds_it_does_not_understand():
    cfg = hybrid_config()
    cfg.kv_cache_groups.append(fakes.KVCacheGroupSpec(["l3"], fakes.ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=8, dtype=fakes.BF16)))
    with pytest.raises(errors.GeometryError, match="KV cache group 2: vLLM spec ChunkedLocalAttentionSpec is not "
                                                   "one kvtier understands"):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)
    cfg = hybrid_config()
    cfg.kv_cache_groups.append(fakes.KVCacheGroupSpec(["m0"], fakes.MambaSpec(
        block_size=BS, shapes=((4, 8),), dtypes=(fakes.BF16,), mamba_cache_mode="none")))
    with pytest.raises(errors.GeometryError, match=r"group 2 \(MambaSpec\): mamba_cache_mode 'none'"):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)


def test_pp_with_several_groups_is_refused_naming_what_is_missing():
    """vLLM's scheduler sees only stage 0's kv_cache_config: another
    stage's layers of each group cannot be derived (kvtier.vllm.spec)."""
    with pytest.raises(errors.GeometryError, match="pipeline parallel size 2 with 2 KV cache groups"):
        make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, hybrid_config(), pp=2, stage_layers=[4, 4], attach=False)


def test_several_groups_need_asynchronous_loads():
    with pytest.raises(errors.GeometryError, match="2 KV cache groups with kvtier_load_async false"):
        make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, hybrid_config(), kvtier_load_async=False)


def test_lookup_offers_only_chunks_whose_window_blocks_vllm_keeps():
    """Window 48, blocks of 16: a restored prefix of T tokens makes vLLM skip
    (T - 47) // 16 sliding-window blocks (its null block in their place), so
    from nothing local at most 3 chunks (48 tokens) are offered; with 2
    chunks local, skipped blocks inside them are fine: up to 62+32 tokens."""
    world = fakes.FakeWorld()
    world.prefix = 99
    s = make(world, KVConnectorRole.SCHEDULER, hybrid_config(), kvtier_load_async=True)
    req = fakes.Request("r", tokens(BS * 8 + 1))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (48, True)
    assert world.lookups[-1].chunks == s.resolved.chunk_hashes(req.prompt_token_ids)[:3]
    req2 = fakes.Request("r2", tokens(BS * 8 + 1))
    world.plan = plan_for(s, req2, 2, 3)
    assert s.get_num_new_matched_tokens(req2, 2 * BS) == (48, True)  # T = 80: skips 2 blocks, both local
    assert world.lookups[-1].chunks == s.resolved.chunk_hashes(req2.prompt_token_ids)[2:5]
    wide = make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, hybrid_config(window=4096), kvtier_load_async=True)
    assert wide._window_chunks(0) == (4096 + BS - 2) // BS  # T <= window + block - 2


def test_saves_name_every_groups_blocks_and_skip_null_blocks():
    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER, hybrid_config(), kvtier_load_async=True)
    req = fakes.Request("r1", tokens(BS * 4 + 1))
    s.get_num_new_matched_tokens(req, 0)
    ids = ([0, 7, 8, 9, 10], [20, 21, 22, 23, 24])  # chunk 0's window block already vLLM's null block
    meta = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("r1", req.prompt_token_ids, ids, 0)],
        num_scheduled_tokens={"r1": BS * 4 + 1}))
    h = s.resolved.chunk_hashes(req.prompt_token_ids)
    assert [(sv.req_id, sv.chunks) for sv in meta.saves] == [
        ("r1", [(bytes(h[c]), [[ids[0][c]], [ids[1][c]]]) for c in (1, 2, 3)])]
    assert s.request_finished_all_groups(req, ([7, 8], [20, 21])) == (True, None)


def hybrid_worker(world, **extra):
    cfg = hybrid_config()
    extra.setdefault("kvtier_load_async", True)
    w = make(world, KVConnectorRole.WORKER, cfg, **extra)
    caches = {}
    for g in cfg.kv_cache_groups:
        page = g.kv_cache_spec.page_size_bytes
        h = g.kv_cache_spec.num_kv_heads
        for name in g.layer_names:
            caches[name] = fakes.Tensor((cfg.num_blocks, 2, BS, h, 8), (page // 2, page // 4, h * 8, 8, 1), 2,
                                        cuda.MemHandle("host", "HOST-t", name.encode(), 0, cfg.num_blocks * page))
    w.register_kv_caches(caches)
    assert w.wait_attached(5), w._link.why
    return w


def load(w, ids, planned=2, items=None):
    """A load of planned chunks from chunk 0 into ids; items: its (chunk,
    group) pairs (default: both groups of every chunk)."""
    pairs = items if items is not None else [(c, g) for c in range(planned) for g in (0, 1)]
    items = [wire.RetrieveItem(chunk=c, group=g, key=dcp.Key(w.resolved.namespace, dcp.ChunkHash(bytes([c]) * 16),
                                                             0, g),
                               source=wire.Source(wire.Rank("engine0", 0), 1)) for c, g in pairs]
    raw = client_plan.PlanItems.of(items).to_bytes()
    return LoadSpec("r1", "r-1", 0, planned, planned, {"engine0/0": raw}, ids, async_load=True)


def run_step(w, loads=(), saves=()):
    w.bind_connector_metadata(KvtierConnectorMetadata(list(loads), list(saves)))
    w.start_load_kv(None)
    w.wait_for_save()
    out = None
    for _ in range(200):  # steps until the load is settled
        out = w.get_transfer_results(set())
        if out.finished_recving:
            break
        import time
        time.sleep(0.01)
    errs = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return out, errs


def test_registers_every_groups_layers():
    world = fakes.FakeWorld()
    hybrid_worker(world)
    (_, _, pools), = world.registered
    assert [(p.group, p.layer) for p in pools] == [(0, 0), (0, 1), (1, 0)]


@pytest.mark.parametrize("failed", [False, True])
def test_several_groups_load_each_groups_blocks_and_fail_per_request(failed):
    """Each group's items get that group's blocks; a failed verdict is the
    request's (failed_recving: vLLM recomputes it), never block ids, which
    vLLM 0.32 refuses with several groups."""
    world = fakes.FakeWorld()
    w = hybrid_worker(world)
    world.verdict = (wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 2, [1], ["rank 0 group 1 shard 0: corrupt"])
                     if failed else wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 2))
    out, errs = run_step(w, loads=[load(w, [[5, 6, 7], [30, 31, 32]])])
    (_, rid, items), = world.retrieves
    assert rid == "r-1"
    assert sorted((it.group, it.chunk, tuple(it.blocks)) for it in items) == [
        (0, 0, (5,)), (0, 1, (6,)), (1, 0, (30,)), (1, 1, (31,))]
    assert out.finished_recving == {"r1"} and errs == set()
    assert out.failed_recving == ({"r1"} if failed else set())
    assert w.stats["restore_failures"] == int(failed) and w.stats["loaded_tokens"] == (0 if failed else 2 * BS)
    assert w.get_transfer_results(set()).failed_recving == set()  # reported once


def test_load_into_the_null_block_is_refused_before_the_rankd():
    world = fakes.FakeWorld()
    w = hybrid_worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 2, [0], ["rank 0 group 0 shard 0: missing"])
    out, _ = run_step(w, loads=[load(w, [[0, 6, 7], [30, 31, 32]])])
    assert world.retrieves == [] and out.failed_recving == {"r1"}
    assert "null block" in w.recent_loads[-1]["problem"]


def test_stores_send_every_groups_blocks_and_wait_with_a_window():
    world = fakes.FakeWorld()
    w = hybrid_worker(world)
    h = bytes([3]) * 16
    run_step(w, saves=[SaveSpec("r1", [(h, [[5], [30]])])])
    (_, req_id, chunks, _), = world.stores
    assert req_id == "r1" and [(bytes(c.chunk), c.blocks) for c in chunks] == [(h, [[5], [30]])]


def test_a_window_makes_the_store_wait_for_its_answer():
    """vLLM frees out-of-window blocks at its next schedule: wait_for_save
    returns only once the rankd answered (bounded by the store's gather limit:
    test_vllm_storewait.py)."""
    import concurrent.futures
    import threading

    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w = hybrid_worker(world)
    w.bind_connector_metadata(KvtierConnectorMetadata([], [SaveSpec("r1", [(bytes(16), [[5], [30]])])]))
    t = threading.Timer(0.3, lambda: world.store_gate.set_result(None))
    t.start()
    w.wait_for_save()
    assert world.store_gate.done()  # it waited for the answer
    t.join()


def test_no_loads_of_several_groups_where_vllm_cannot_take_their_failure_back(monkeypatch, caplog):
    """vLLM 0.26 reads no failed_recving (no get_transfer_results) and its
    block-level load errors take one group only: a failed load of a hybrid
    model would run on pages never written (the H200 run of 2026-12-04: a
    Gemma-2 generated other tokens than vLLM alone). There the connector
    offers no load for several groups, says why, and stores go on; one
    group keeps its loads (block-level errors work)."""
    from kvtier.vllm import _base

    monkeypatch.setattr(_base, "TAKES_FAILED_RECVING", False)
    world = fakes.FakeWorld()
    world.prefix = 99
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        s = make(world, KVConnectorRole.SCHEDULER, hybrid_config(), kvtier_load_async=True)
    assert "2 KV cache groups on a vLLM without per-request load failures" in s.loads_off
    assert any("kvtier restores nothing for this model" in r.getMessage() for r in caplog.records), caplog.text
    req = fakes.Request("r", tokens(BS * 8 + 1))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not world.lookups  # not even asked
    ids = ([7, 8, 9, 10, 11], [20, 21, 22, 23, 24])
    meta = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("r", req.prompt_token_ids, ids, 0)],
        num_scheduled_tokens={"r": BS * 4 + 1}))
    assert [c for sv in meta.saves for c, _ in sv.chunks]  # stores go on
    one = make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, fakes.attention_config(), kvtier_load_async=True)
    assert one.loads_off == ""
