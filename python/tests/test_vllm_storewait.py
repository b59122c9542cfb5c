"""The connector's stores carry a short deadline (issue 24): vLLM holds a
request's blocks until its store answers, so a rankd waiting for L1 room
(write-through behind a slow disk) must answer by kvtier_store_wait_s. A
step that waits for a store (sliding-window and Mamba groups) waits only
until that deadline plus kvtier_store_grace_s (C11)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from test_vllm_connector import bind, worker

import fakes
from kvtier.vllm import KvtierConnectorMetadata, SaveSpec


def _store_deadline(w, world) -> tuple[float, float, float]:
    """Saves one chunk; returns the time before the save, the store's
    deadline and the time its answer was seen."""
    bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
    t0 = time.time()
    w.wait_for_save()
    w.clear_connector_metadata()
    for p in [p for v in w._pending.values() for p in v]:
        p.fut.result(5)
    (deadline,) = world.store_deadlines
    assert deadline is not None
    return t0, deadline, time.time()


def test_store_carries_the_store_wait_as_its_deadline():
    """By default a store's deadline is 2 s from the save, far below the
    request timeout (30 s) the rankd's store timeout used to bound."""
    world = fakes.FakeWorld()
    w = worker(world)
    assert w.cfg.store_wait_s == 2.0 < w.cfg.timeout_s
    t0, deadline, t1 = _store_deadline(w, world)
    assert t0 + 2.0 <= deadline <= t1 + 2.0


def test_store_wait_option():
    world = fakes.FakeWorld()
    w = worker(world, kvtier_store_wait_s=0.5)
    t0, deadline, t1 = _store_deadline(w, world)
    assert t0 + 0.5 <= deadline <= t1 + 0.5
    for bad in (0, -1):
        with pytest.raises(ValueError, match="kvtier_store_wait_s"):
            worker(fakes.FakeWorld(), kvtier_store_wait_s=bad)


def test_store_grace_option():
    assert worker(fakes.FakeWorld()).cfg.store_grace_s == 0.5
    assert worker(fakes.FakeWorld(), kvtier_store_grace_s=0).cfg.store_grace_s == 0
    with pytest.raises(ValueError, match="kvtier_store_grace_s"):
        worker(fakes.FakeWorld(), kvtier_store_grace_s=-0.1)


def _windowed(kind: str, world, **extra):
    from test_vllm_hybrid import hybrid_worker
    from test_vllm_mamba import mamba_worker

    if kind == "window":
        return hybrid_worker(world, **extra), [[5], [30]]
    return mamba_worker(world, **extra), [[5], [30, 31]]


@pytest.mark.parametrize("kind", ["window", "mamba"])
def test_a_step_waits_for_a_store_only_until_its_gather_limit(kind):
    """C11, issue 24: a sliding-window or Mamba group makes vLLM's step wait
    for the store (vLLM frees those blocks without asking), but a rankd
    that never answers holds the step only until the store's deadline plus
    kvtier_store_grace_s, the gather limit the store carries (the rankd
    commits nothing it copied later): then the step goes on, counted in
    store_waits_cut. The request still finishes only once the store
    answered. Red with the step waiting up to kvtier_timeout_s (5 s here)."""
    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w, blocks = _windowed(kind, world, kvtier_store_wait_s=0.2, kvtier_store_grace_s=0.1, kvtier_timeout_s=5)
    try:
        w.bind_connector_metadata(KvtierConnectorMetadata([], [SaveSpec("r1", [(bytes(16), blocks)])]))
        t0 = time.time()
        w.wait_for_save()
        t1 = time.time()
        w.clear_connector_metadata()
        (deadline,), (limit,) = world.store_deadlines, world.store_gather_limits
        assert deadline is not None and limit == pytest.approx(deadline + 0.1)
        assert t0 + 0.2 <= deadline <= t1
        assert limit <= t1 < limit + 1.0, f"the step waited {t1 - t0:.2f} s for a store that never answered"
        assert w.stats["store_waits_cut"] == 1
        assert not world.store_gate.done()
        assert w.get_finished({"r1"}) == (None, None)  # the store has not answered
    finally:
        world.store_gate.set_result(None)
    for p in [p for v in w._pending.values() for p in v]:
        p.fut.result(5)
    assert w.get_finished(set()) == ({"r1"}, None)


def test_a_store_the_step_does_not_wait_for_still_carries_its_gather_limit():
    """Full attention: vLLM keeps the blocks until the request is reported
    finished, so wait_for_save returns at once and cuts nothing; the store
    still carries its gather limit (the deadline plus the grace), since a
    preemption frees the blocks without asking and the worker then waits
    only until that limit (handle_preemptions)."""
    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w = worker(world)
    try:
        bind(w, saves=[SaveSpec("r1", [(bytes(16), [[1]])])])
        t0 = time.time()
        w.wait_for_save()
        assert time.time() - t0 < 0.5
        for _ in range(100):  # the store is sent from the client's loop
            if world.store_gather_limits:
                break
            time.sleep(0.01)
        (deadline,), (limit,) = world.store_deadlines, world.store_gather_limits
        assert limit is not None and abs(limit - deadline - w.cfg.store_grace_s) < 1e-6
        assert w.stats["store_waits_cut"] == 0
    finally:
        world.store_gate.set_result(None)


def test_a_step_of_several_stores_waits_until_the_latest_limit_only():
    """All the step's stores are sent before it waits, so two stores that
    never answer hold it about one gather limit, not one after the other.
    Red when each store is waited for before the next is sent (1.8 s)."""
    world = fakes.FakeWorld()
    world.store_gate = concurrent.futures.Future()
    w, blocks = _windowed("window", world, kvtier_store_wait_s=0.8, kvtier_store_grace_s=0.1, kvtier_timeout_s=5)
    try:
        w.bind_connector_metadata(KvtierConnectorMetadata([], [SaveSpec("r1", [(bytes(16), blocks)]),
                                                               SaveSpec("r2", [(bytes([1]) * 16, blocks)])]))
        t0 = time.time()
        w.wait_for_save()
        took = time.time() - t0
        w.clear_connector_metadata()
        assert time.time() >= max(world.store_gather_limits)
        assert took < 1.5, f"the step waited {took:.2f} s for two stores that never answered"
        assert w.stats["store_waits_cut"] == 2
    finally:
        world.store_gate.set_result(None)
