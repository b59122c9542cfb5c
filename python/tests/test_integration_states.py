"""A Mamba / attention hybrid through the Python client against real
daemons (a coordinator and one rankd, host backend): chunks stored without
their state (an engine that kept none at their end), found and restored
with state_at_end up to the chunk with its state, every byte compared
(issue 27). The vLLM connector's path, without vLLM: test_vllm_mamba_real.py
runs it inside vLLM (make test-vllm)."""

from __future__ import annotations

import pathlib
import random

import pytest

from cluster import HOST_UUID, Cluster, eventually, running
from kvtier import client, cuda, dcp, wire

pytestmark = pytest.mark.integration

BLOCKS = 12  # per layer pool, both groups
PAD = 0xEE
SPEC = dcp.Spec(
    model="pytest-hybrid", cache_salt="st",
    layout=dcp.Layout(tp=1, dcp=1, interleave=1, pp=1),
    groups=[dcp.Group(name="mamba", kind=dcp.Kind.RECURRENT, block_size=32, layers=1,
                      semantic_bytes=512, page_bytes=512, stride_bytes=512 + 64, kv_format="mamba_f32"),
            dcp.Group(name="attn", kind=dcp.Kind.ATTENTION, block_size=16, layers=2,
                      semantic_bytes=16 * 64, page_bytes=16 * 64, stride_bytes=16 * 64, kv_format="bf16")],
    chunk_tokens=32,
)


@pytest.fixture
def cluster(binaries: pathlib.Path, tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    yield from running(Cluster(binaries, tmp_path, 1), request)


def test_stateless_chunks_restore_up_to_the_state(cluster: Cluster) -> None:
    r = SPEC.resolve()
    dev = cuda.HostDevice(str(cluster.shm), HOST_UUID)
    mems, pools = [], []
    for gi, geo in enumerate(r.geometry):
        size = geo.pool_bytes(BLOCKS)
        m = dev.alloc(size * geo.group.layers)
        m.view[:] = bytes([PAD]) * len(m.view)
        mems.append((m, size))
        pools += [wire.PoolRegistration(gi, layer, m.export(layer * size, size)) for layer in range(geo.group.layers)]

    def off(gi: int, layer: int, block: int) -> int:
        return layer * mems[gi][1] + block * r.geometry[gi].group.stride_bytes

    def page(gi: int, chunk: int, layer: int, k: int) -> bytes:
        return random.Random(f"{gi}/{chunk}/{layer}/{k}").randbytes(r.geometry[gi].group.page_bytes)

    def put(gi: int, layer: int, block: int, data: bytes) -> None:
        o = off(gi, layer, block)
        mems[gi][0].view[o:o + len(data)] = data

    tokens = [random.Random(3).randrange(1 << 32) for _ in range(3 * 32 + 1)]
    hashes = r.chunk_hashes(tokens)
    # Chunks 0 and 1 stored without their state, chunk 2 with it.
    attn_store, state_store = [[0, 1], [2, 3], [4, 5]], 7
    attn_back, state_back = [[6, 7], [8, 9], [10, 11]], 2
    with client.SyncClient(cluster.connect_options(timeout=20)) as c:
        ns = eventually("coordinator registers the spec", lambda: c.register_spec(SPEC))
        rk = wire.Rank("engine0", 0)
        eventually("rankd accepts", lambda: c.status(rk).accepting or (_ for _ in ()).throw(AssertionError("not yet")))
        cluster.wait_resynced()  # no lookup below may fall in a startup resync's window
        s = c.register(rk, SPEC, HOST_UUID, pools)
        chunks = []
        for ch in range(3):
            for layer in range(2):
                for k, b in enumerate(attn_store[ch]):
                    put(1, layer, b, page(1, ch, layer, k))
            state = []
            if ch == 2:
                put(0, 0, state_store, page(0, ch, 0, 0))
                state = [state_store]
            chunks.append(wire.ChunkBlocks(hashes[ch], [state, attn_store[ch]], ch))
        ev = dev.new_event()
        ev.record()
        rep = s.store("prompt", chunks, ev.export())
        ev.release()
        assert (rep.stored, rep.failed) == (4, []), rep  # 3 attention objects, 1 state

        assert eventually("the stateless chain is found",
                          lambda: _at_least(c.lookup(ns, hashes, instance="engine0", state_at_end=True), 3)).prefix == 3
        assert c.lookup(ns, hashes, instance="engine0").prefix == 0  # strictly, chunk 0 lacks its state

        for gi, geo in enumerate(r.geometry):  # wipe every declared page
            for layer in range(geo.group.layers):
                for b in range(BLOCKS):
                    put(gi, layer, b, bytes(geo.group.page_bytes))

        def blocks_for(_: wire.Rank, it: wire.RetrieveItem) -> list[int]:
            if it.group == 0:
                assert it.chunk == 2, f"a state asked for chunk {it.chunk}"
                return [state_back]
            return attn_back[it.chunk]

        assert c.restore({str(rk): s}, hashes, blocks_for, instance="engine0").verdict is None  # strict: nothing
        out = c.restore({str(rk): s}, hashes, blocks_for, instance="engine0", state_at_end=True)
        assert out.verdict is not None and out.verdict.state == wire.VERDICT_COMPLETE, out
        assert (out.loaded, out.failed) == (3, [])

        # Every byte: the restored pages, zeros in every other declared page, padding untouched.
        for gi, geo in enumerate(r.geometry):
            m, size = mems[gi]
            want = bytearray([PAD]) * len(m.view)
            for layer in range(geo.group.layers):
                for b in range(BLOCKS):
                    o = off(gi, layer, b)
                    want[o:o + geo.group.page_bytes] = bytes(geo.group.page_bytes)
            for ch in range(3):
                for layer in range(geo.group.layers):
                    if gi == 1:
                        for k, b in enumerate(attn_back[ch]):
                            o = off(gi, layer, b)
                            want[o:o + geo.group.page_bytes] = page(gi, ch, layer, k)
                    elif ch == 2:
                        o = off(gi, layer, state_back)
                        want[o:o + geo.group.page_bytes] = page(gi, ch, layer, 0)
            assert bytes(m.view) == bytes(want), f"group {gi} differs"
        s.release()
    for m, _ in mems:
        m.release()


def _at_least(rep: wire.LookupReply, n: int) -> wire.LookupReply:
    if rep.prefix < n:
        raise AssertionError(f"prefix {rep.prefix}, want {n}")
    return rep
