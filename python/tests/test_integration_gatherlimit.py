"""The store's gather limit (Kvtier-Gather-Limit, issue 24, C11) from the
Python client to a real rankd: a gather that ends after the limit (the
engine had stopped waiting and may have reused the blocks) stores nothing;
one that ends within it is stored. Red when the client's header name is
not the one the rankd reads: the late gather was stored."""

from __future__ import annotations

import time

import pytest
from test_integration import SPEC, TP, Worker, _full, cluster, page_bytes  # noqa: F401

from cluster import HOST_UUID, Cluster, eventually
from kvtier import client, cuda, wire

pytestmark = pytest.mark.integration


def test_a_gather_ending_after_its_limit_stores_nothing(cluster: Cluster) -> None:  # noqa: F811
    r = SPEC.resolve()
    dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
    workers = [Worker(dev, t, r) for t in range(TP)]
    ranks = [wire.Rank("engine0", t) for t in range(TP)]
    page = r.geometry[0].group.page_bytes
    for w in workers:
        for layer in range(3):
            for b in (0, 1):
                w.write_page(layer, b, page_bytes(w.tp, 0, layer, b, page))
    with client.SyncClient(cluster.connect_options(timeout=20)) as c:
        eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))
        sessions = {str(rk): eventually(f"rankd {rk} registers",
                                        lambda rk=rk: c.register(rk, SPEC, HOST_UUID, workers[rk.tp_rank].pools))
                    for rk in ranks}
        h = r.chunk_hashes(list(range(SPEC.chunk_tokens)))

        def store(req: str, deadline_s: float, limit_s: float, hold_s: float) -> list[wire.StoreReply]:
            """Stores chunk 0 on every rank, its producer event completing
            hold_s after the send (the forward still writing)."""
            sent = []
            now = time.time()
            for rk in ranks:
                ev = dev.new_event()
                ev.record(completed=False)
                sent.append((ev, sessions[str(rk)].store_async(req, [wire.ChunkBlocks(h[0], [[0, 1]])], ev.export(),
                                                               deadline=now + deadline_s,
                                                               gather_limit=now + limit_s)))
            time.sleep(hold_s)
            for ev, _ in sent:
                ev.complete()
            out = []
            for ev, f in sent:
                out.append(f.result(30))
                ev.release()
            return out

        for rep in store("late", 0.2, 0.4, 0.8):
            assert rep.stored == 0 and len(rep.failed) == 1 and rep.failed[0].endswith(": timeout"), rep
        time.sleep(0.5)  # an event of a stored object would have reached the index by now
        assert c.lookup(r.namespace, h, instance="engine0").prefix == 0

        for rep in store("in-time", 30, 30, 0.1):
            assert (rep.stored, rep.failed) == (1, []), rep
        eventually("lookup shows chunk 0", lambda: _full(c.lookup(r.namespace, h, instance="engine0"), 1))
        for s in sessions.values():
            s.release()
    for w in workers:
        w.mem.release()
