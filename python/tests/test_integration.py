"""The Python client against real daemons: coordinator (embedded NATS) and
two rankds on the host backend. Pools are host-backend "device" memory made
by kvtier.cuda.HostDevice; the test stores every chunk, wipes every page,
restores into other blocks through the client and compares every byte,
padding included."""

from __future__ import annotations

import hashlib
import pathlib
import random
import re
import subprocess
import time

import pytest

from cluster import HOST_UUID, Cluster, eventually, running
from kvtier import client, cuda, dcp, errors, wire

pytestmark = pytest.mark.integration

TP = 2
BLOCKS = 24  # per layer pool
CHUNKS = 5
SPEC = dcp.Spec(
    model="pytest-tiny", cache_salt="it",
    layout=dcp.Layout(tp=TP, dcp=1, interleave=1, pp=1),
    groups=[dcp.Group(name="attn", kind=dcp.Kind.ATTENTION, block_size=16, layers=3,
                      semantic_bytes=16 * 528, page_bytes=16 * 561, stride_bytes=16 * 561 + 37,
                      kv_format="fp8_tail")],
    chunk_tokens=32,
)
PAD = 0xEE


@pytest.fixture
def cluster(binaries: pathlib.Path, tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    yield from running(Cluster(binaries, tmp_path, TP), request)


class Worker:
    """One TP rank's engine side: a host-backend allocation holding every
    layer's pool at an odd offset (the handles carry offsets), and the
    pages' expected contents."""

    def __init__(self, dev: cuda.HostDevice, tp: int, r: dcp.Resolved) -> None:
        self.tp, self.r = tp, r
        self.geo = r.geometry[0]
        self.pool = self.geo.pool_bytes(BLOCKS)
        self.layer_stride = self.pool + 4099  # not page aligned
        layers = self.geo.group.layers
        self.mem = dev.alloc(self.layer_stride * layers)
        self.mem.view[:] = bytes([PAD]) * len(self.mem.view)
        self.pools = [wire.PoolRegistration(0, layer, self.mem.export(layer * self.layer_stride, self.pool))
                      for layer in range(layers)]

    def page_off(self, layer: int, block: int) -> int:
        return layer * self.layer_stride + block * self.geo.group.stride_bytes

    def write_page(self, layer: int, block: int, data: bytes) -> None:
        o = self.page_off(layer, block)
        self.mem.view[o:o + len(data)] = data

    def read_page(self, layer: int, block: int) -> bytes:
        o = self.page_off(layer, block)
        return bytes(self.mem.view[o:o + self.geo.group.page_bytes])


def page_bytes(tp: int, chunk: int, layer: int, k: int, n: int) -> bytes:
    seed = hashlib.sha256(f"{tp}/{chunk}/{layer}/{k}".encode()).digest()
    return random.Random(seed).randbytes(n)


def test_store_wipe_restore_every_byte(cluster: Cluster) -> None:
    r = SPEC.resolve()
    bpc = r.blocks_per_chunk(0)
    assert bpc == 2
    rng = random.Random(7)
    tokens = [rng.randrange(1 << 32) for _ in range(CHUNKS * SPEC.chunk_tokens + 5)]
    hashes = r.chunk_hashes(tokens)
    assert len(hashes) == CHUNKS
    store_blocks = rng.sample(range(BLOCKS), CHUNKS * bpc)
    restore_blocks = rng.sample(range(BLOCKS), CHUNKS * bpc)

    dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
    workers = [Worker(dev, t, r) for t in range(TP)]
    opts = cluster.connect_options(timeout=20)
    with client.SyncClient(opts) as c:
        ns = eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))
        assert ns == r.namespace
        ranks = [wire.Rank("engine0", t) for t in range(TP)]
        for rk in ranks:
            eventually(f"rankd {rk} accepts", lambda rk=rk: c.status(rk).accepting or (_ for _ in ()).throw(
                AssertionError("not accepting yet")))
        for rk in ranks:
            st = c.status(rk)
            assert (st.rank, st.tp_size, st.device.backend, st.device.uuid) == (rk, TP, "host", HOST_UUID)
        cluster.wait_resynced()  # no lookup below may fall in a startup resync's window
        sessions = {str(rk): c.register(rk, SPEC, HOST_UUID, workers[rk.tp_rank].pools) for rk in ranks}

        # Compute and store: every chunk its own store with its own event (C1).
        layers = r.geometry[0].group.layers
        page = r.geometry[0].group.page_bytes
        futures = []
        events = []
        for w, rk in zip(workers, ranks, strict=True):
            for ch in range(CHUNKS):
                blocks = store_blocks[ch * bpc:(ch + 1) * bpc]
                for layer in range(layers):
                    for k, b in enumerate(blocks):
                        w.write_page(layer, b, page_bytes(w.tp, ch, layer, k, page))
                ev = dev.new_event()
                ev.record()
                events.append(ev)
                futures.append(sessions[str(rk)].store_async(
                    "prompt-1", [wire.ChunkBlocks(hashes[ch], [blocks])], ev.export()))
        replies = [f.result(60) for f in futures]
        for ev in events:
            ev.release()
        assert all(not rep.failed and not rep.blocks_in_use for rep in replies), replies
        assert sum(rep.stored for rep in replies) == TP * CHUNKS

        lk = eventually("lookup covers the prompt", lambda: _full(c.lookup(ns, hashes, instance="engine0"), CHUNKS))
        assert lk.prefix == CHUNKS

        # Storing the same chunk again is deduplicated.
        ev = dev.new_event()
        ev.record()
        again = sessions[str(ranks[0])].store("prompt-1", [wire.ChunkBlocks(hashes[0], [store_blocks[:bpc]])],
                                              ev.export())
        ev.release()
        assert (again.stored, again.deduped) == (0, 1)

        # Wipe every declared page (prefix cache reset); padding stays.
        snapshot_pad = [bytes(w.mem.view) for w in workers]

        def wipe() -> None:
            for w in workers:
                for layer in range(layers):
                    for b in range(BLOCKS):
                        w.write_page(layer, b, bytes(page))

        def blocks_for(rank: wire.Rank, it: wire.RetrieveItem) -> list[int]:
            assert it.group == 0
            return restore_blocks[it.chunk * bpc:(it.chunk + 1) * bpc]

        def check_restored() -> None:
            """Every byte: restored pages hold what was stored, other pages
            are still wiped, padding is untouched."""
            gs = r.geometry[0].group
            for w in workers:
                view = bytes(w.mem.view)
                want = bytearray(len(view))
                want[:] = bytes([PAD]) * len(view)
                for layer in range(layers):
                    for b in range(BLOCKS):
                        o = w.page_off(layer, b)
                        want[o:o + page] = bytes(page)
                for ch in range(CHUNKS):
                    for layer in range(layers):
                        for k, b in enumerate(restore_blocks[ch * bpc:(ch + 1) * bpc]):
                            o = w.page_off(layer, b)
                            want[o:o + page] = page_bytes(w.tp, ch, layer, k, page)
                assert gs.stride_bytes > page
                assert view == bytes(want), f"rank {w.tp}: {_first_diff(view, bytes(want))}"
                assert len(snapshot_pad[w.tp]) == len(view)

        wipe()
        out = c.restore(sessions, hashes, blocks_for, instance="engine0", deadline_ms=10000)
        assert out.verdict is not None and out.verdict.state == wire.VERDICT_COMPLETE, out
        assert (out.loaded, out.failed) == (CHUNKS, [])
        check_restored()
        # The same through a BlockTable: the plan's items stay packed
        # (retrieve_packed), the bytes are the same.
        wipe()
        out = c.restore(sessions, hashes, client.BlockTable([restore_blocks], [bpc]), instance="engine0",
                        deadline_ms=10000)
        assert out.verdict is not None and out.verdict.state == wire.VERDICT_COMPLETE, out
        assert (out.loaded, out.failed) == (CHUNKS, [])
        check_restored()

        # A restore of chunks never stored plans nothing.
        other = r.chunk_hashes([t ^ 1 for t in tokens])
        none = c.restore(sessions, other, blocks_for, instance="engine0")
        assert (none.loaded, none.verdict) == (0, None)

        # Bad input gets an error reply with its stable code.
        with pytest.raises(errors.BadRequest):
            sessions[str(ranks[0])].retrieve([])
        for s in sessions.values():
            s.release()
        with pytest.raises(errors.WireError) as ei:
            ev = dev.new_event()
            ev.record()
            try:
                sessions[str(ranks[0])].store("after-release", [wire.ChunkBlocks(hashes[0], [store_blocks[:bpc]])],
                                              ev.export())
            finally:
                ev.release()
        # The released session is stale: never served again.
        assert ei.value.code == wire.CODE_STALE_SESSION, ei.value
    for w in workers:
        w.mem.release()


def test_store_waits_for_its_event_and_fails_when_it_is_destroyed(cluster: Cluster) -> None:
    """C1 through the Python host event. A store sent before its pages are
    written waits for the event (the bytes it commits are the ones written
    after the request); a store whose event is destroyed while the rankd
    waits on it commits nothing."""
    r = SPEC.resolve()
    dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
    workers = [Worker(dev, t, r) for t in range(TP)]
    ranks = [wire.Rank("engine0", t) for t in range(TP)]
    page = r.geometry[0].group.page_bytes
    opts = cluster.connect_options(timeout=20)
    with client.SyncClient(opts) as c:
        eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))
        sessions = {str(rk): eventually(f"rankd {rk} registers",
                                        lambda rk=rk: c.register(rk, SPEC, HOST_UUID, workers[rk.tp_rank].pools))
                    for rk in ranks}
        cluster.wait_resynced()  # no lookup below may fall in a startup resync's window
        h = r.chunk_hashes(list(range(2 * SPEC.chunk_tokens)))

        # Pending events: the stores must wait, then commit the late bytes.
        pending = []
        for rk in ranks:
            ev = dev.new_event()
            ev.record(completed=False)
            pending.append((ev, sessions[str(rk)].store_async("late", [wire.ChunkBlocks(h[0], [[0, 1]])],
                                                              ev.export())))
        for w in workers:
            for layer in range(3):
                for b in (0, 1):
                    w.write_page(layer, b, page_bytes(w.tp, 0, layer, b, page))
        assert not any(f.done() for _, f in pending)
        for ev, _ in pending:
            ev.complete()
        for ev, f in pending:
            rep = f.result(30)
            ev.release()
            assert (rep.stored, rep.failed) == (1, [])
        ns = r.namespace
        eventually("lookup shows chunk 0", lambda: _full(c.lookup(ns, h[:1], instance="engine0"), 1))
        for w in workers:
            for layer in range(3):
                for b in (0, 1):
                    w.write_page(layer, b, bytes(page))
        out = c.restore(sessions, h[:1], lambda _r, it: [4, 5], instance="engine0")
        assert out.loaded == 1, out
        for w in workers:
            for layer in range(3):
                for k, b in enumerate((4, 5)):
                    assert w.read_page(layer, b) == page_bytes(w.tp, 0, layer, k, page)

        # Destroyed while the rankd waits on it: nothing is committed.
        ev = dev.new_event()
        ev.record(completed=False)
        fut = sessions[str(ranks[0])].store_async("dead-event", [wire.ChunkBlocks(h[1], [[2, 3]])], ev.export())
        # Give the rankd time to import the event and wait on it; if it has
        # not yet, the import fails instead: either way nothing commits.
        time.sleep(0.3)
        assert not fut.done()
        ev.release()
        try:
            rep = fut.result(30)
        except errors.WireError as e:
            assert e.code in (wire.CODE_BAD_REQUEST, wire.CODE_INTERNAL), e
        else:
            assert rep.stored == 0 and rep.failed, rep
        lk = c.lookup(ns, h, instance="engine0", detail=True)
        assert lk.prefix == 1
        assert all(src.chunk == 0 for src in lk.sources), lk
        for s in sessions.values():
            s.release()
    for w in workers:
        w.mem.release()


def test_anonymous_and_unknown_connections_are_refused(cluster: Cluster) -> None:
    """Secure by default: the coordinator's NATS refuses a connection
    without credentials (even over TLS with the right CA) and one whose
    seed is not in its users file."""
    ca = str(cluster.creds / "ca.pem")
    anon = client.ConnectOptions(servers=[cluster.nats_url], insecure=True, tls_ca_file=ca, connect_timeout=5)
    with pytest.raises(errors.NotConnected, match=r"as anonymous:.*[Aa]uthorization"):
        client.SyncClient(anon)
    # engine0's seed from another cluster's init: a user this one never issued.
    other = cluster.root / "other-creds"
    subprocess.run([str(cluster.bin / "coordinator"), "init", "--dir", str(other), "--instance", "engine0"],
                   check=True, timeout=60, stdout=subprocess.DEVNULL)
    forged = cluster.connect_options(nkey_seed_file=str(other / "engine-engine0.nk"), connect_timeout=5)
    with pytest.raises(errors.NotConnected, match=r"[Aa]uthorization"):
        client.SyncClient(forged)
    # The engine's own credentials are accepted.
    with client.SyncClient(cluster.connect_options(timeout=20)) as c:
        eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))


def test_forged_and_other_instance_requests_are_refused(cluster: Cluster) -> None:
    """Connected as engine-engine0, the Python client cannot speak for
    another instance or a rank: NATS refuses the publish (Unauthorized once
    the request times out), and the coordinator refuses a body that names
    another instance on engine0's own subject (code unauthorized)."""
    r = SPEC.resolve()
    ns = r.namespace
    h = r.chunk_hashes(list(range(SPEC.chunk_tokens)))
    with client.SyncClient(cluster.connect_options(timeout=3)) as c:
        eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))
        assert c.lookup(ns, h, instance="engine0").prefix == 0  # its own instance: served
        subjects = c.aio.subjects
        # Another instance's coordinator subject.
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.coord.lookup.engine1")):
            c.lookup(ns, h, instance="engine1")
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.coord.restore.wait.engine1")):
            c.run(c.aio.restore_wait("0" * 32, instance="engine1"))
        # restore.cancel: its own instance's subject is served (an unknown
        # restore), another instance's refused by NATS.
        with pytest.raises(errors.WireError) as wi:
            c.restore_cancel("0" * 32, instance="engine0")
        assert wi.value.code == "not_found", wi.value
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.coord.restore.cancel.engine1")):
            c.restore_cancel("0" * 32, instance="engine1")
        # Its own subject, a body naming another instance: the coordinator refuses.
        with pytest.raises(errors.Unauthorized) as ei:
            c.run(c.aio.call(subjects.engine_coord("engine0", wire.COORD_LOOKUP),
                             wire.LookupRequest(ns, list(h), "engine1"), wire.LookupReply))
        assert ei.value.code == "unauthorized" and "engine1" in str(ei.value), ei.value
        # A forged restore report of rank engine0/0 (only that rankd may send it).
        report = wire.RestoreReport("0" * 32, wire.Rank("engine0", 0), [])
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.coord.restore.report.engine0.0")):
            c.run(c.aio.call(subjects.report(wire.Rank("engine0", 0)), report, wire.ReportAck))
        # The unscoped subject (served only by an --insecure coordinator).
        with pytest.raises(errors.Unauthorized, match=r'to "kvtier\.coord\.lookup"'):
            c.run(c.aio.call(subjects.coord(wire.COORD_LOOKUP), wire.LookupRequest(ns, list(h), "engine0"),
                             wire.LookupReply))
        # Another instance's rankd.
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.rank.engine1.0.engine.status")):
            c.status(wire.Rank("engine1", 0))
        # cut: its own rankd answers (nothing of that request in flight),
        # another instance's is refused by NATS.
        cut = wire.CutRequest("no-such-request")
        own = subjects.engine(wire.Rank("engine0", 0), wire.OP_CUT)
        assert c.run(c.aio.call(own, cut, wire.CutReply)).stores == 0
        # Bounded by a deadline (the rankd's strict decoder knows the field).
        bounded = wire.CutRequest("no-such-request", int((time.time() + 1) * 1e9))
        assert c.run(c.aio.call(own, bounded, wire.CutReply)).stores == 0
        with pytest.raises(errors.Unauthorized, match=re.escape("kvtier.rank.engine1.0.engine.cut")):
            c.run(c.aio.call(subjects.engine(wire.Rank("engine1", 0), wire.OP_CUT), cut, wire.CutReply))


def _full(lk: wire.LookupReply, n: int) -> wire.LookupReply:
    if lk.prefix != n:
        raise AssertionError(f"lookup prefix {lk.prefix} of {n} ({lk.reason})")
    return lk


def _first_diff(a: bytes, b: bytes) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return f"first difference at byte {i}: {x:#04x} != {y:#04x}"
    return "lengths differ"
