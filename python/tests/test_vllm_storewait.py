"""The connector's stores carry a short deadline (issue 24): vLLM holds a
request's blocks until its store answers, so a rankd waiting for L1 room
(write-through behind a slow disk) must answer by kvtier_store_wait_s."""

from __future__ import annotations

import time

import pytest
from test_vllm_connector import bind, worker

import fakes
from kvtier.vllm import SaveSpec


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
