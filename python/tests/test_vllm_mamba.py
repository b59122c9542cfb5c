"""Mamba / linear-attention state groups (vLLM's MambaSpec in
mamba_cache_mode "align") in the connector, against fakes of vLLM's
objects and of kvtier's client (issue 27.1). Real vLLM with a Mamba2 /
attention hybrid: test_vllm_mamba_real.py."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import threading
from dataclasses import dataclass

import pytest
from test_vllm_connector import make, tokens
from test_vllm_hybrid import load, run_step

import fakes
from kvtier import cuda, dcp, errors, wire
from kvtier.vllm import KvtierConnectorMetadata, SaveSpec, spec_from_vllm
from kvtier.vllm.connector import KVConnectorRole

BS = 32  # vLLM's block of both groups
CHUNK = 64  # two blocks


@dataclass(frozen=True)
class MambaSpec(fakes.MambaSpec):
    """vLLM's MambaSpec with its speculative blocks (EAGLE/MTP)."""

    num_speculative_blocks: int = 0


def mamba_config(mode: str = "align", num_blocks: int = 64, **kw) -> fakes.KVCacheConfig:
    """granite-4.0-h-like: group 0 Mamba (one layer, a padded state page),
    group 1 full attention (one layer)."""
    mamba = MambaSpec(block_size=BS, shapes=((4, 8), (2, 16)), dtypes=(fakes.BF16, fakes.BF16),
                            page_size_padded=2048, mamba_cache_mode=mode, **kw)
    full = fakes.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=fakes.BF16)
    return fakes.KVCacheConfig(num_blocks, [], [fakes.KVCacheGroupSpec(["m0"], mamba),
                                                fakes.KVCacheGroupSpec(["a1"], full)])


def sched(world=None):
    return make(world or fakes.FakeWorld(), KVConnectorRole.SCHEDULER, mamba_config(), kvtier_chunk_tokens=CHUNK,
                kvtier_load_async=True)


def step(new=(), cached=None, handoffs=None, sched_tokens=None):
    """A SchedulerOutput with vLLM's boundary-state hand-offs:
    {req: [(group, block, tokens before the state)]}."""
    out = fakes.SchedulerOutput(scheduled_new_reqs=list(new), num_scheduled_tokens=dict(sched_tokens or {}))
    if cached is not None:
        out.scheduled_cached_reqs = cached
    out.kv_connector_block_state = type("BlockState", (), {"boundary_state_offloads": handoffs or {}})()
    return out


def test_spec_mamba_align_is_one_recurrent_page_per_chunk():
    spec, layers = spec_from_vllm(mamba_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=CHUNK)
    r = spec.resolve()
    g = spec.groups[0]
    assert (g.kind, g.block_size, g.semantic_bytes, g.page_bytes) == (dcp.Kind.RECURRENT, CHUNK, 2 * 32 + 2 * 32,
                                                                       2048)
    assert [r.blocks_per_chunk(i) for i in range(2)] == [1, 2]
    assert [(gl.recurrent, gl.block_size) for gl in layers] == [(True, BS), (False, BS)]
    assert g.kv_format == "mamba:mamba2:bfloat16,bfloat16"
    cfg = mamba_config()
    backend = enum.Enum("MambaAttentionBackendEnum", "MAMBA2")  # what vLLM's MambaSpec.mamba_type is
    cfg.kv_cache_groups[0].kv_cache_spec = dataclasses.replace(cfg.kv_cache_groups[0].kv_cache_spec,
                                                               mamba_type=backend.MAMBA2)
    assert spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=CHUNK)[0] == spec
    default, _ = spec_from_vllm(mamba_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)
    assert default.chunk_tokens == 256 and default.groups[0].block_size == 256
    other, _ = spec_from_vllm(mamba_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=2 * CHUNK)
    assert other.resolve().namespace != r.namespace  # another chunk: another state per object


@pytest.mark.parametrize("cfg, chunk, words", [
    (mamba_config("none"), CHUNK, r"group 0 \(MambaSpec\): mamba_cache_mode 'none'; kvtier stores the state at a "
                                  "chunk boundary"),
    (mamba_config(num_speculative_blocks=1), CHUNK, r"group 0 \(MambaSpec\): 1 speculative blocks"),
    (mamba_config(), 48, r"group 0 \(MambaSpec\): chunk of 48 tokens is not a multiple of vLLM's Mamba block of 32"),
])
def test_spec_mamba_refusals_name_the_rule(cfg, chunk, words):
    with pytest.raises(errors.GeometryError, match=words):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=chunk)


def test_a_chunk_is_stored_with_the_state_vllm_handed_over_or_without_one():
    """Prompt of 3 chunks + 5 in one step: vLLM hands over the state at 128
    only (its checkpoint): chunk 1 is stored with that block as its Mamba
    page, whatever the block table holds at index 3; chunk 0 without a
    Mamba page (no state at 64: its attention only); chunk 2 not yet (192
    not computed)."""
    s = sched()
    req = fakes.Request("r1", tokens(3 * CHUNK + 5))
    s.get_num_new_matched_tokens(req, 0)
    ids = ([0, 0, 0, 41, 42, 43, 44], [10, 11, 12, 13, 14, 15, 16])  # Mamba: nulls, the checkpoint, running state
    meta = s.build_connector_meta(step(
        new=[fakes.NewRequestData("r1", req.prompt_token_ids, ids, 0)], sched_tokens={"r1": 2 * CHUNK + 3},
        handoffs={"r1": [(0, 77, 2 * CHUNK)], "gone": [(0, 9, CHUNK)]}))
    h = s.resolved.chunk_hashes(req.prompt_token_ids)
    assert [(sv.req_id, sv.chunks, sv.positions) for sv in meta.saves] == [
        ("r1", [(bytes(h[0]), [[], [10, 11]]), (bytes(h[1]), [[77], [12, 13]])], [0, 1])]
    # the next step ends at 192 on a block boundary: its state handed over, chunk 2 stored
    cached = fakes.CachedRequestData(req_ids=["r1"], new_block_ids=[None], num_computed_tokens=[2 * CHUNK + 3])
    meta = s.build_connector_meta(step(cached=cached, handoffs={"r1": [(0, 78, 3 * CHUNK)]},
                                       sched_tokens={"r1": CHUNK - 3}))
    assert [(sv.chunks, sv.positions) for sv in meta.saves] == [([(bytes(h[2]), [[78], [14, 15]])], [2])]


def test_lookup_offers_every_stored_chunk_and_the_load_targets_the_state_block_vllm_allocates():
    """vLLM allocates one block for the state of a restored prefix of T
    tokens, at index T // 32 - 1 of the Mamba group, and none inside it: the
    restore asks for the Mamba page of its last chunk only (state_at_end),
    which lands there, and spans every chunk the cache holds."""
    world = fakes.FakeWorld()
    world.prefix = 3
    s = sched(world)
    req = fakes.Request("r1", tokens(4 * CHUNK + 1))
    hashes = s.resolved.chunk_hashes(req.prompt_token_ids)
    key = lambda c, g: dcp.Key(s.resolved.namespace, hashes[c], 0, g)  # noqa: E731
    src = wire.Source(wire.Rank("engine0", 0), wire.Tier.L1)
    # chunks 1-3 (vLLM holds chunk 0): attention of each, the Mamba state of chunk 3 only
    world.plan = wire.RestorePlan("r-1", 3, {"engine0/0": [
        wire.RetrieveItem(chunk=0, group=1, key=key(1, 1), sum=1, source=src),
        wire.RetrieveItem(chunk=1, group=1, key=key(2, 1), sum=2, source=src),
        wire.RetrieveItem(chunk=2, group=0, key=key(3, 0), sum=3, source=src),
        wire.RetrieveItem(chunk=2, group=1, key=key(3, 1), sum=4, source=src)]})
    assert s.get_num_new_matched_tokens(req, CHUNK) == (3 * CHUNK, True)  # 3 chunks past vLLM's, all offered
    assert world.lookups[-1].chunks == hashes[1:4] and world.lookups[-1].state_at_end
    assert world.begins_state_at_end == [True]
    # vLLM's table after the allocation: Mamba nulls, the local state (block 3), nulls inside the
    # restored prefix, the restored state's block (index 7: tokens 224..256), the running state;
    # attention blocks of every token
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([0, 3, 0, 0, 0, 0, 0, 50, 51],
                                                         list(range(20, 29)))), 3 * CHUNK)
    meta = s.build_connector_meta(step())
    (ld,) = meta.loads
    assert (ld.first_chunk, ld.chunks, ld.planned) == (1, 3, 3)
    assert ld.block_ids == [[3, 0, 0, 50], list(range(20, 29))]  # Mamba: the state at each chunk's end
    assert ld.problem == ""


def test_a_multi_chunk_mamba_load_places_only_the_last_state():
    """The worker places the attention pages of every chunk and the Mamba
    page of the last chunk in the block vLLM allocated; a failed verdict
    fails the whole request (several groups: vLLM recomputes it)."""
    world = fakes.FakeWorld()
    w = mamba_worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    items = [(0, 1), (1, 1), (2, 0), (2, 1)]
    out, errs = run_step(w, loads=[load(w, [[0, 0, 50], [20, 21, 22, 23, 24, 25]], planned=3, items=items)])
    assert out.finished_recving == {"r1"} and not out.failed_recving and not errs
    (_, _, placed), = world.retrieves[-1:]
    assert [(it.chunk, it.group, it.blocks) for it in placed] == [
        (0, 1, [20, 21]), (1, 1, [22, 23]), (2, 0, [50]), (2, 1, [24, 25])]
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 3, [2], ["rank 0 group 0 shard 0: corrupt"])
    out, _ = run_step(w, loads=[load(w, [[0, 0, 50], [20, 21, 22, 23, 24, 25]], planned=3, items=items)])
    assert out.failed_recving == {"r1"}
    assert w.stats["restore_failures"] == 1


def mamba_worker(world, **extra):
    cfg = mamba_config()
    w = make(world, KVConnectorRole.WORKER, cfg, kvtier_load_async=True, kvtier_chunk_tokens=CHUNK, **extra)
    caches = {}
    for g in cfg.kv_cache_groups:
        page = g.kv_cache_spec.page_size_bytes
        for name in g.layer_names:
            caches[name] = fakes.Tensor((cfg.num_blocks, page // 2), (page // 2, 1), 2,
                                        cuda.MemHandle("host", "HOST-t", name.encode(), 0, cfg.num_blocks * page))
    w.register_kv_caches(caches)
    assert w.wait_attached(5), w._link.why
    return w


def test_worker_places_the_mamba_page_in_its_block_and_refuses_the_null_block():
    world = fakes.FakeWorld()
    w = mamba_worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 1)
    out, errs = run_step(w, loads=[load(w, [[50, 51], [20, 21, 22, 23]], planned=1)])
    assert out.finished_recving == {"r1"} and not out.failed_recving and not errs
    (_, _, items), = world.retrieves[-1:]
    assert [(it.group, it.blocks) for it in items] == [(0, [50]), (1, [20, 21])]
    n = len(world.retrieves)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 1, [0], ["rank 0 group 0 shard 0: missing"])
    out, _ = run_step(w, loads=[load(w, [[0, 51], [20, 21, 22, 23]], planned=1)])
    assert out.failed_recving == {"r1"} and len(world.retrieves) == n  # never sent to the rankd


def test_a_mamba_group_makes_the_store_wait_for_its_answer():
    """vLLM frees a state block behind the request's last state at a later
    schedule without asking the connector: wait_for_save returns only once
    the rankd answered."""
    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w = mamba_worker(world)
    w.bind_connector_metadata(KvtierConnectorMetadata([], [SaveSpec("r1", [(bytes(16), [[5], [30, 31]])])]))
    t = threading.Timer(0.3, lambda: world.store_gate.set_result(None))
    t.start()
    w.wait_for_save()
    assert world.store_gate.done()  # it waited for the answer
    t.join()


def test_a_chunk_without_its_state_is_stored_with_its_attention_and_counted():
    """A chunk whose state vLLM did not keep goes to the rankd with no
    block ids for the Mamba group (its attention only), counted in
    stored_without_state; a chunk with its state is not counted."""
    world = fakes.FakeWorld()
    w = mamba_worker(world)
    h0, h1 = bytes([1]) * 16, bytes([2]) * 16
    save = SaveSpec("r1", [(h0, [[], [30, 31]]), (h1, [[6], [32, 33]])])
    w.bind_connector_metadata(KvtierConnectorMetadata([], [save]))
    w.wait_for_save()
    (_, _, chunks, _), = world.stores
    assert [(bytes(c.chunk), c.blocks) for c in chunks] == [(h0, [[], [30, 31]]), (h1, [[6], [32, 33]])]
    assert w.stats["stored_without_state"] == 1


def test_a_mamba_tensor_is_its_states_bytes_a_page_apart():
    """vLLM hands the connector a Mamba layer as (num_blocks, 1, 1, state
    bytes) int8 rows a padded page apart: accepted (the pool is the whole
    pages); a row longer than the page, or rows another stride apart, is
    refused."""
    w = mamba_worker(fakes.FakeWorld())
    content = 2 * 32 + 2 * 32
    w._check_layout(0, "m0", fakes.Tensor((64, 1, 1, content), (2048, content, content, 1), 1))
    with pytest.raises(errors.GeometryError, match=r"layer m0 \(group 0\): tensor of shape \(64, 1, 1, 2049\)"):
        w._check_layout(0, "m0", fakes.Tensor((64, 1, 1, 2049), (2048, 2049, 2049, 1), 1))
    with pytest.raises(errors.GeometryError, match="64 blocks of page_size_bytes 2048 B"):
        w._check_layout(0, "m0", fakes.Tensor((64, 1, 1, content), (4096, content, content, 1), 1))
    with pytest.raises(errors.GeometryError, match="tensor of shape"):  # an attention group stays dense
        w._check_layout(1, "a1", fakes.Tensor((64, 1, 1, 100), (2048, 100, 100, 1), 1))
