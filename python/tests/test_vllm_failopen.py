"""C11 on the connector's logic (fakes of vLLM and of kvtier's client): a
cache that is down, slow or crashing costs a request at most its bounded
timeout and a recompute; vLLM's calls never wait on it. The same with real
vLLM and real daemons: test_vllm_real.py (make test-vllm)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from test_vllm_connector import bind, eventually, load_spec, make, plan_for, tokens, worker

import fakes
from kvtier import errors, wire
from kvtier.vllm import SaveSpec
from kvtier.vllm.attach import Link
from kvtier.vllm.connector import KVConnectorRole


def test_a_lookup_that_timed_out_is_a_miss_not_not_yet():
    """The bug of issue 31: RequestTimeout is a TimeoutError, and a lookup
    future that failed with it was read as "not yet" forever."""
    world = fakes.FakeWorld()
    world.prefix = 3
    world.lookup_error = errors.RequestTimeout("no reply from kvtier.coord.lookup within 2.0 s")
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_lookup_wait_s=0.5)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # settled: no second lookup
    assert len(world.lookups) == 1 and s.stats["lookup_timeouts"] == 1


def test_a_lookup_without_any_answer_is_given_up_after_its_bound():
    """A lookup whose own timeouts never fire (a wedged client loop) is
    given up after twice kvtier_lookup_timeout_s plus a second."""
    world = fakes.FakeWorld()
    world.prefix = 3
    world.lookup_gate = concurrent.futures.Future()  # never answered
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_lookup_wait_s=0.0, kvtier_lookup_timeout_s=0.05)
    req = fakes.Request("r1", tokens(16 * 5 + 3))
    t0 = time.monotonic()
    got = s.get_num_new_matched_tokens(req, 0)
    while got == (None, False):
        assert time.monotonic() - t0 < 5, "still 'not yet' after 5 s"
        time.sleep(0.01)
        got = s.get_num_new_matched_tokens(req, 0)
    assert got == (0, False) and 1.0 <= time.monotonic() - t0 < 3
    assert s.stats["lookup_timeouts"] == 1
    eventually("the lookup is cancelled", world.lookup_gate.cancelled)


def test_scheduler_starts_with_kvtier_down_and_attaches_later():
    world = fakes.FakeWorld()
    world.prefix = 2
    down = [True]

    def connect() -> fakes.FakeSyncClient:
        if down[0]:
            raise errors.NotConnected("connect to NATS at nats://127.0.0.1:4222: no connection within 2.0 s")
        return fakes.FakeSyncClient(world)

    t0 = time.monotonic()
    s = make(world, KVConnectorRole.SCHEDULER, client_factory=connect, attach=False,
             kvtier_attach_backoff_max_s=0.05)
    assert time.monotonic() - t0 < 1, "the constructor waited on kvtier"
    req = fakes.Request("a", tokens(40))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # a miss at once
    assert s.stats["lookups_skipped"] == 1 and world.lookups == []
    eventually("the link retries", lambda: s._link.attempts >= 3)
    down[0] = False
    assert s.wait_attached(5), s._link.why
    b = fakes.Request("b", tokens(40))
    world.plan = plan_for(s, b, 0, 2)
    assert s.get_num_new_matched_tokens(b, 0) == (32, False)
    assert world.specs == [s.spec] and s._link.attaches == 1
    s.shutdown()


def test_worker_starts_with_rankd_down_serves_without_it_then_attaches():
    world = fakes.FakeWorld()
    fail = [errors.Unavailable("unavailable", "no responders on kvtier.rank.engine0.0.engine.register")]
    orig = fakes.FakeSyncClient.register

    def register(self, rank, spec, device_uuid, pools):
        if fail:
            raise fail[0]
        return orig(self, rank, spec, device_uuid, pools)

    fakes.FakeSyncClient.register = register
    try:
        t0 = time.monotonic()
        w = worker(world, attach=False, kvtier_attach_backoff_max_s=0.05)
        assert time.monotonic() - t0 < 1, "register_kv_caches waited on the rankd"
        # a save while detached: skipped, and the request is still reported finished
        bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
        w.wait_for_save()
        assert w.stats["stores_skipped"] == 1 and world.stores == []
        assert w.get_finished({"r1"}) == ({"r1"}, None)
        # a load while detached: every block an error, at once
        bind(w, loads=[load_spec(w)])
        w.start_load_kv(None)
        assert w.get_block_ids_with_load_errors() == {21, 22, 23}
        assert w.stats["loads_skipped"] == 1
        fail.clear()
        assert w.wait_attached(5), w._link.why
        bind(w, saves=[SaveSpec("r2", [(bytes(16), [[1]])])])
        w.wait_for_save()
        eventually("the store is sent", lambda: len(world.stores) == 1)
    finally:
        fakes.FakeSyncClient.register = orig


def test_rankd_that_stops_answering_makes_the_worker_detach_and_come_back():
    world = fakes.FakeWorld()
    w = worker(world, kvtier_health_check_s=0.02)
    world.status_error = errors.RequestTimeout("no reply from kvtier.rank.engine0.0.engine.status")
    eventually("unhealthy", lambda: w._link.state == "unhealthy")
    bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
    w.wait_for_save()
    assert w.stats["stores_skipped"] == 1
    world.status_error = None  # the same incarnation answers again: no new registration
    eventually("attached again", lambda: w._link.state == "attached")
    assert len(world.registered) == 1
    w.get_kv_connector_stats()
    assert w.stats["detaches"] == 1 and w.stats["attaches"] == 2


def test_async_load_returns_at_once_and_reports_through_get_finished():
    world = fakes.FakeWorld()
    w = worker(world)
    gate: concurrent.futures.Future[None] = concurrent.futures.Future()
    orig = fakes.FakeAio.restore_wait

    async def slow_wait(self, restore_id, *, timeout=None, instance=None):
        await asyncio.wrap_future(gate)
        return wire.RestoreVerdict("r-1", wire.VERDICT_FAILED, 3, [2], ["chunk 2: rank 0 group 0 shard 0: checksum "
                                                                         "mismatch: placed 0x1, recorded 0x2"])

    fakes.FakeAio.restore_wait = slow_wait
    try:
        bind(w, loads=[load_spec(w, async_load=True)])
        t0 = time.monotonic()
        w.start_load_kv(None)
        assert time.monotonic() - t0 < 0.5, "start_load_kv waited for the verdict"
        assert w.get_finished(set()) == (None, None)
        assert w.get_block_ids_with_load_errors() == set()
        gate.set_result(None)
        eventually("load done", lambda: all(ld.fut.done() for ld in w._loading.values()))
        # finished and its errors in the same step (vLLM's contract for async loads)
        assert w.get_finished(set()) == (None, {"r1"})
        assert w.get_block_ids_with_load_errors() == {23}
        assert w.stats["loaded_tokens"] == 32 and w.stats["recomputed_bad_bytes_tokens"] == 16
        st = w.get_kv_connector_stats()
        assert st is not None and st.data["loaded_tokens"] == 32 and st.data["load_failed_tokens"] == 16
        assert st.data["recomputed_bad_bytes_tokens"] == 16 and st.data["loads"] == 1
        assert w.get_kv_connector_stats() is None  # nothing moved since
    finally:
        fakes.FakeAio.restore_wait = orig


def test_async_load_without_a_verdict_is_given_up_within_its_bound():
    world = fakes.FakeWorld()
    w = worker(world, kvtier_restore_deadline_ms=100, kvtier_lookup_timeout_s=0.1)
    orig = fakes.FakeAio.restore_wait

    async def never(self, restore_id, *, timeout=None, instance=None):
        await asyncio.sleep(3600)

    fakes.FakeAio.restore_wait = never
    try:
        bind(w, loads=[load_spec(w, async_load=True)])
        t0 = time.monotonic()
        w.start_load_kv(None)
        got = (None, None)
        while got[1] is None:
            assert time.monotonic() - t0 < 5, "the load was never given up"
            time.sleep(0.02)
            got = w.get_finished(set())
        assert got == (None, {"r1"}) and time.monotonic() - t0 < 2.5
        assert w.get_block_ids_with_load_errors() == {21, 22, 23}
    finally:
        fakes.FakeAio.restore_wait = orig


def test_shutdown_is_bounded_when_a_store_never_answers():
    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()  # the rankd never answers
    w = worker(world, kvtier_shutdown_timeout_s=0.5)
    bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
    w.wait_for_save()
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 2.0


def test_link_rejects_bad_timings_and_backs_off_with_jitter():
    with pytest.raises(ValueError, match="backoff"):
        Link("x", lambda: None, lambda c: None, backoff_s=0)  # type: ignore[arg-type,return-value]
    link = Link("x", lambda: None, lambda c: None, backoff_s=0.1, max_backoff_s=1.0)  # type: ignore[arg-type,return-value]
    d = [link._delay(a) for a in range(12)]
    assert all(0.05 <= x <= 1.0 for x in d) and max(d[8:]) > 0.5


def test_config_rejects_nonsense_timeouts():
    from kvtier.vllm.connector import Config

    with pytest.raises(ValueError, match="kvtier_lookup_timeout_s"):
        Config.of(fakes.vllm_config(1, kvtier_creds_dir="/c", kvtier_lookup_timeout_s=0))
    with pytest.raises(ValueError, match="not a boolean"):
        Config.of(fakes.vllm_config(1, kvtier_creds_dir="/c", kvtier_load_async="maybe"))
    c = Config.of(fakes.vllm_config(1, kvtier_creds_dir="/c"))
    assert (c.load_async, c.lookup_timeout_s, c.shutdown_timeout_s) == (True, 2.0, 5.0)


def test_a_request_is_offered_kvtier_tokens_once():
    """Real vLLM asks again after an asynchronous load failed (the request
    goes back to waiting with no computed tokens): offering the same tokens
    again looped forever (seen with vLLM 0.32 CPU: the same three requests
    loaded and failed hundreds of times a second). After its load is issued
    a request is a miss."""
    world = fakes.FakeWorld()
    world.prefix = 2
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_load_async=True)
    req = fakes.Request("r", tokens(40))
    world.plan = plan_for(s, req, 0, 2)
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)
    s.update_state_after_alloc(req, fakes.KVCacheBlocks(([4, 5, 6],)), 32)
    meta = s.build_connector_meta(fakes.SchedulerOutput())
    assert [ld.restore_id for ld in meta.loads] == ["r-1"]
    # the load failed; vLLM frees the blocks and asks again from token 0
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.build_connector_meta(fakes.SchedulerOutput()).loads == []
    assert len(world.lookups) == 1


def test_wait_attached_waits_for_the_peer_not_only_for_nats():
    """A link made unhealthy by a NATS outage hands out its client again as
    soon as NATS reconnects (requests use it at once), but wait_attached
    waits until a health check has seen the peer answer: real vLLM's
    fail-open test read the counters between the two (attaches 1)."""
    world = fakes.FakeWorld()
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_attach_backoff_max_s=0.05)
    assert s.wait_attached(5), s._link.why
    link = s._link
    link._set("unhealthy", "NATS disconnected; reconnecting")
    with link._mu:
        link._nats_down = True
    assert s._client_now() is not None, "NATS is back: the client is usable"
    assert not s.wait_attached(0.1), "attached before the peer answered again"
    link._set("attached", "answering again")
    assert s.wait_attached(0.1) and link.attaches == 2 and link.detaches == 1
    s.shutdown()


def test_a_slow_coordinator_costs_a_step_one_wait_budget_not_one_per_request():
    """vLLM asks every waiting request in a step; with the coordinator slow
    (lookups in flight, unanswered) each ask waited kvtier_lookup_wait_s,
    so 50 waiting requests held one step 50 times that (0.5 s here). The
    wait is a budget of the step: build_connector_meta renews it. Red with
    a wait per call."""
    world = fakes.FakeWorld()
    world.prefix = 3
    world.lookup_gate = concurrent.futures.Future()  # never answered
    s = make(world, KVConnectorRole.SCHEDULER, kvtier_lookup_wait_s=0.01, kvtier_lookup_timeout_s=30)
    reqs = [fakes.Request(f"r{i}", tokens(16 * 5 + 3 + i)) for i in range(50)]
    for _ in range(2):
        t0 = time.monotonic()
        assert all(s.get_num_new_matched_tokens(r, 0) == (None, False) for r in reqs)
        took = time.monotonic() - t0
        assert took < 0.1, f"one step waited {took:.3f} s for 50 lookups in flight"
        s.build_connector_meta(fakes.SchedulerOutput())
    # The budget is spent on the first ask of a step, and renewed per step.
    t0 = time.monotonic()
    s.get_num_new_matched_tokens(reqs[0], 0)
    assert time.monotonic() - t0 >= 0.009
    world.lookup_gate.set_result(None)
