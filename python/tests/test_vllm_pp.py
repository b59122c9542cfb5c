"""Pipeline parallel (PP > 1) in the connector, on fakes: every stage is a
kvtier world of its own (its layers, namespace, chunk hashes and ranks
"<instance>-pp<stage>"), the scheduler restores only the prefix every
stage holds, and each worker stores and restores its own stage's objects."""

from __future__ import annotations

import pytest
from test_vllm_connector import attached, bind, eventually, make, tokens

import fakes
from kvtier import client_plan, cuda, dcp, errors, wire
from kvtier.vllm import LoadSpec, SaveSpec
from kvtier.vllm.connector import KVConnectorRole

# A 3-layer model on two stages: vLLM's even split gives stage 0 two
# layers and stage 1 one (get_pp_indices puts the remainder first).
STAGE_LAYERS = [2, 1]


def stage_cfg(stage: int) -> fakes.KVCacheConfig:
    first = sum(STAGE_LAYERS[:stage])
    return fakes.attention_config(layers=STAGE_LAYERS[stage], first_layer=first)


def scheduler(world):
    return make(world, KVConnectorRole.SCHEDULER, stage_cfg(0), pp=2, stage_layers=STAGE_LAYERS)


def stage_worker(world, stage: int, attach: bool = True):
    cfg = stage_cfg(stage)
    w = make(world, KVConnectorRole.WORKER, cfg, pp=2, pp_stage=stage, stage_layers=STAGE_LAYERS)
    page = cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    first = sum(STAGE_LAYERS[:stage])
    w.register_kv_caches({
        name: fakes.Tensor((cfg.num_blocks, 2, 16, 2, 8), (page // 2, 256, 16, 8, 1), 2,
                           cuda.MemHandle("host", "HOST-t", b"pool", (first + i) << 20, cfg.num_blocks * page))
        for i, name in enumerate(cfg.kv_cache_groups[0].layer_names)})
    return attached(w) if attach else w


def stage_hashes(s, req):
    """The request's chunk hashes in each stage's namespace."""
    return [r.chunk_hashes(req.prompt_token_ids) for r in s.stages]


def plan(r: dcp.Resolved, rank: str, restore_id: str, hashes, n: int) -> wire.RestorePlan:
    items = [wire.RetrieveItem(chunk=c, group=0, key=dcp.Key(r.namespace, hashes[c], 0, 0), sum=c + 1,
                               source=wire.Source(wire.Rank.parse(rank), wire.Tier.L1)) for c in range(n)]
    return wire.RestorePlan(restore_id, n, {rank: items})


def test_each_stage_is_its_own_world_and_both_sides_agree():
    world = fakes.FakeWorld()
    s = scheduler(world)
    w0, w1 = stage_worker(world, 0), stage_worker(world, 1)
    assert [r.spec.groups[0].layers for r in s.stages] == [2, 1]
    assert [(r.spec.layout.pp, r.spec.layout.pp_stage) for r in s.stages] == [(2, 0), (2, 1)]
    assert s.stages[0].namespace != s.stages[1].namespace
    # What the scheduler derives for a stage is what that stage's worker
    # reads from its own kv_cache_config.
    assert [w0.resolved.namespace, w1.resolved.namespace] == [r.namespace for r in s.stages]
    ranks = [(rank, len(pools)) for rank, _, pools in world.registered]
    assert ranks == [(wire.Rank("engine0-pp0", 0), 2), (wire.Rank("engine0-pp1", 0), 1)]
    assert s.instances == ["engine0-pp0", "engine0-pp1"]
    # The scheduler registers every stage's spec.
    assert sorted(str(sp.resolve().namespace) for sp in world.specs) == sorted(str(r.namespace) for r in s.stages)


def test_a_chunk_is_a_hit_only_when_every_stage_holds_it():
    world = fakes.FakeWorld()
    s = scheduler(world)
    ns0, ns1 = (r.namespace for r in s.stages)
    req = fakes.Request("r1", tokens(16 * 4 + 5))
    h0, h1 = stage_hashes(s, req)
    assert h0 != h1  # each stage's own chain
    world.prefix_by_ns = {ns0: 3, ns1: 2}  # stage 1 holds one chunk fewer
    world.plan_by_ns = {ns0: plan(s.stages[0], "engine0-pp0/0", "r-0", h0, 2),
                        ns1: plan(s.stages[1], "engine0-pp1/0", "r-1", h1, 2)}
    assert s.get_num_new_matched_tokens(req, 0) == (32, False)
    assert sorted((str(lk.namespace), lk.instance) for lk in world.lookups) == sorted(
        [(str(ns0), "engine0-pp0"), (str(ns1), "engine0-pp1")])
    # The restore begins on the common prefix, in each stage with its hashes.
    assert sorted((str(ns), [bytes(h) for h in hs], inst) for ns, hs, inst in world.begins) == sorted(
        [(str(ns0), [bytes(h) for h in h0[:2]], "engine0-pp0"), (str(ns1), [bytes(h) for h in h1[:2]], "engine0-pp1")])
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([10, 11, 12, 13, 14],)), 32)
    out = fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("r1", req.prompt_token_ids, ([10, 11, 12, 13, 14],), 32)],
        num_scheduled_tokens={"r1": 37})
    meta = s.build_connector_meta(out)
    (ld,) = meta.loads
    assert (ld.restore_id, ld.stage_restore_ids, ld.planned) == ("r-0", ["r-0", "r-1"], 2)
    assert sorted(ld.items) == ["engine0-pp0/0", "engine0-pp1/0"]
    # Chunks 2 and 3 are computed in this step: stored under each stage's hashes.
    (sv,) = meta.saves
    assert [h for h, _ in sv.chunks] == [bytes(h0[2]), bytes(h0[3])]
    assert sv.stage_hashes == [[bytes(h0[2]), bytes(h0[3])], [bytes(h1[2]), bytes(h1[3])]]


def test_a_stage_without_the_chunk_is_a_miss():
    world = fakes.FakeWorld()
    s = scheduler(world)
    world.prefix_by_ns = {s.stages[0].namespace: 4, s.stages[1].namespace: 0}
    req = fakes.Request("r1", tokens(16 * 4 + 5))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert world.begins == []


def test_stages_whose_plans_differ_are_a_miss():
    """An object went between a stage's lookup and its begin: stage 1's
    plan covers fewer chunks, and its items past the common prefix would
    name blocks vLLM never allocates. Recomputed, nothing loaded."""
    world = fakes.FakeWorld()
    s = scheduler(world)
    ns0, ns1 = (r.namespace for r in s.stages)
    req = fakes.Request("r1", tokens(16 * 4 + 5))
    h0, h1 = stage_hashes(s, req)
    world.prefix = 2
    world.plan_by_ns = {ns0: plan(s.stages[0], "engine0-pp0/0", "r-0", h0, 2),
                        ns1: plan(s.stages[1], "engine0-pp1/0", "r-1", h1, 1)}
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_each_stage_worker_stores_and_restores_its_own():
    world = fakes.FakeWorld()
    w1 = stage_worker(world, 1)
    h0 = [bytes([i]) * 16 for i in range(2)]
    h1 = [bytes([0x80 | i]) * 16 for i in range(2)]
    bind(w1, saves=[SaveSpec("r1", [(h0[0], [[1]]), (h0[1], [[2]])], [0, 1], [h0, h1])])
    w1.wait_for_save()
    w1.clear_connector_metadata()
    eventually("the store to reach the rankd", lambda: len(world.stores) == 1)
    ((rank, _, chunks, _),) = world.stores
    assert rank == wire.Rank("engine0-pp1", 0)
    assert [bytes(c.chunk) for c in chunks] == h1
    # The load: this stage's restore id, its rank's items, its verdict.
    items = [wire.RetrieveItem(chunk=c, group=0, key=dcp.Key(w1.resolved.namespace, dcp.ChunkHash(h1[c])),
                               source=wire.Source(wire.Rank("engine0-pp1", 0), 1)) for c in range(2)]
    raw = {"engine0-pp1/0": client_plan.PlanItems.of(items).to_bytes(),
           "engine0-pp0/0": client_plan.PlanItems.of([]).to_bytes()}
    world.verdict_by_id = {"r-1": wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 2)}
    bind(w1, loads=[LoadSpec("r2", "r-0", 0, 2, 2, raw, [[20, 21, 22]], async_load=False,
                             stage_restore_ids=["r-0", "r-1"])])
    w1.start_load_kv(None)
    ((rank, rid, got),) = [(r, i, it) for r, i, it in world.retrieves]
    assert (rank, rid, [it.blocks for it in got]) == (wire.Rank("engine0-pp1", 0), "r-1", [[20], [21]])
    assert w1.get_block_ids_with_load_errors() == set()
    assert w1.stats["loaded_tokens"] == 32
    # Its verdict is asked on its stage's instance, which began the restore
    # (the coordinator refuses a wait from another instance's subject).
    assert world.waits == [("r-1", "engine0-pp1")]


def test_pp_refuses_what_the_scheduler_cannot_derive():
    world = fakes.FakeWorld()
    # A stage whose group holds fewer layers than vLLM's partition gives it
    # (a layer without KV): another stage's spec cannot be derived.
    with pytest.raises(errors.GeometryError, match="does not hold every decoder layer"):
        make(world, KVConnectorRole.SCHEDULER, fakes.attention_config(layers=1), pp=2, stage_layers=STAGE_LAYERS,
             attach=False)
    # A worker whose own config is not what the partition says.
    with pytest.raises(errors.GeometryError, match="does not hold every decoder layer"):
        make(world, KVConnectorRole.WORKER, fakes.attention_config(layers=2, first_layer=2), pp=2, pp_stage=1,
             stage_layers=STAGE_LAYERS)
    # Several KV cache groups: the scheduler sees only stage 0's.
    two = fakes.attention_config(layers=2)
    spec = two.kv_cache_groups[0].kv_cache_spec
    two.kv_cache_groups = [fakes.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec),
                           fakes.KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec)]
    with pytest.raises(errors.GeometryError, match="2 KV cache groups"):
        make(world, KVConnectorRole.SCHEDULER, two, pp=2, stage_layers=STAGE_LAYERS, attach=False)
