"""Geometry rules (C2) and identity, with the numbers in the errors."""

import json
import pathlib

import pytest

from kvtier import dcp, wire
from kvtier.errors import GeometryError, MalformedError


def spec(chunk: int = 64, **g) -> dcp.Spec:
    grp = dict(name="attn", kind=dcp.Kind.ATTENTION, block_size=16, layers=1, semantic_bytes=16 * 528,
               page_bytes=16 * 561, stride_bytes=16 * 561 + 37, kv_format="fp8")
    grp.update(g)
    return dcp.Spec(model="m", layout=dcp.Layout(4, 2, 1, 1), groups=[dcp.Group(**grp)], chunk_tokens=chunk)


@pytest.mark.parametrize("change, words", [
    (dict(page_bytes=200_000, stride_bytes=160_000), "declared page 200000 B exceeds block stride 160000 B"),
    (dict(semantic_bytes=9000, page_bytes=8976), "semantic page 9000 B exceeds declared page 8976 B"),
    (dict(block_size=0), "block size 0 tokens must be >= 1"),
    (dict(layers=0), "layer count 0 must be >= 1"),
    (dict(kind=dcp.Kind.RECURRENT, mla=True), "MLA applies to attention groups"),
    (dict(block_size=24), "not a multiple of the scheduler block 48"),
])
def test_geometry_rules(change, words):
    with pytest.raises(GeometryError, match=words):
        spec(**change).resolve()


def test_layout_rules():
    s = spec()
    s.layout = dcp.Layout(tp=6, dcp=4)
    with pytest.raises(GeometryError, match="TP size 6 is not divisible by DCP size 4"):
        s.resolve()
    s.layout = dcp.Layout(tp=2, dcp=1, pp=2, pp_stage=2)
    with pytest.raises(GeometryError, match=r"PP stage 2 of PP size 2: want 0\.\.1"):
        s.resolve()
    s.layout = dcp.Layout(tp=2, dcp=1, pp=0)
    with pytest.raises(GeometryError, match=r"PP size 0: want 1\.\.256"):
        s.resolve()
    # Every stage of a PP layout is a namespace of its own; PP 1 encodes no stage.
    namespaces = set()
    for pp, stage in ((1, 0), (2, 0), (2, 1), (3, 1)):
        s.layout = dcp.Layout(tp=2, dcp=1, pp=pp, pp_stage=stage)
        namespaces.add(s.resolve().namespace)
    assert len(namespaces) == 4


def test_seed_geometries():
    # packed NVFP4: one opaque slot per block
    r = spec(chunk=1024, block_size=512, semantic_bytes=155_648, page_bytes=177_408, stride_bytes=200_000).resolve()
    assert (r.geometry[0].slots, r.geometry[0].tiled) == (1, False)
    # 561-byte rows tile
    r = spec().resolve()
    assert (r.geometry[0].slots, r.geometry[0].slot_bytes, r.geometry[0].span) == (16, 561, 32)
    # recurrent, DCP2: split in two
    r = spec(kind=dcp.Kind.RECURRENT, block_size=64, semantic_bytes=4096 * 265, page_bytes=4096 * 265,
             stride_bytes=4096 * 266).resolve()
    assert (r.geometry[0].slots, r.geometry[0].span) == (2, 64)


def test_mla_shards():
    r = spec(mla=True).resolve()
    assert [(p.shard, p.writer, p.readers) for p in r.shards(0)] == [(0, 0, (0, 2)), (1, 1, (1, 3))]
    assert [r.store_shard(0, t) for t in range(4)] == [0, 1, None, None]
    assert [r.read_shard(0, t) for t in range(4)] == [0, 1, 0, 1]


def test_identity_separates_geometry_and_salt():
    a = spec().resolve().namespace
    assert spec(stride_bytes=16 * 561 + 38).resolve().namespace != a
    s = spec()
    s.cache_salt = "other"
    assert s.resolve().namespace != a
    s = spec()
    s.groups[0].name = "renamed"  # names are not identity
    assert s.resolve().namespace == a


def test_key_text_and_binary_reject_bad_input():
    for bad in ["", "x", "a.b.c.d", "0" * 32 + "." + "0" * 32 + ".01.0", "0" * 32 + "." + "0" * 32 + ".0.65536",
                "0" * 31 + "G." + "0" * 32 + ".0.0"]:
        with pytest.raises(MalformedError):
            dcp.Key.parse(bad)
    with pytest.raises(MalformedError):
        dcp.Key.from_binary(bytes(36))
    with pytest.raises(MalformedError):
        dcp.Key.from_binary(b"\x02" + bytes(36))


@pytest.mark.parametrize("data", [b"{", b"[]", b'{"model":1}', b'{"groups":[{"kind":9}]}',
                                  b'{"layout":{"tp":true}}', b'{"groups":[{"page_bytes":-1}]}',
                                  b'{"groups":[{"page_bytes":18446744073709551616}]}'])
def test_decode_rejects_bad_types(data):
    with pytest.raises(MalformedError):
        wire.decode(dcp.Spec, data)


def test_decode_ignores_unknown_fields():
    s = wire.decode(dcp.Spec, b'{"model":"m","future":{"x":1}}')
    assert s.model == "m"


def test_chunk_hashes_reject_out_of_range_tokens():
    for bad in ([1 << 32, 0], [-1, 0], [0.5, 0], [0, 0, 0, "x"]):
        with pytest.raises(MalformedError, match=f"chunk {len(bad) // 2 - 1}"):
            dcp.chunk_hashes(dcp.Namespace(), bad, 2)


def test_chunk_hashes_are_the_chain_of_the_definition():
    """The tokens packed at once give the chain the definition states,
    chunk by chunk: h_k = SHA-256(h_{k-1} || chunk k as little-endian
    uint32s)[:16] from the namespace; a partial chunk gets no hash and its
    tokens are not checked."""
    import hashlib
    import random
    import struct

    rng = random.Random(5)
    ns = dcp.Namespace(rng.randbytes(16))
    for chunk_tokens in (1, 3, 16, 256):
        tokens = [rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(32)]) for _ in range(chunk_tokens * 7)]
        want, prev = [], bytes(ns)
        for k in range(len(tokens) // chunk_tokens):
            prev = hashlib.sha256(prev + struct.pack(f"<{chunk_tokens}I",
                                                     *tokens[k * chunk_tokens:(k + 1) * chunk_tokens])).digest()[:16]
            want.append(dcp.ChunkHash(prev))
        partial = [-1] * (chunk_tokens - 1)  # never a full chunk: not hashed, not checked
        assert dcp.chunk_hashes(ns, tokens + partial, chunk_tokens) == want and len(want) == 7


VLLM_SLOTS = pathlib.Path(__file__).resolve().parents[2] / "dcp" / "testdata" / "vllm_dcp_slots.json"


def test_local_slot_is_vllms_dcp_slot_mapping():
    """dcp/testdata/vllm_dcp_slots.json holds vLLM's DCP slot mapping
    (every rank's slot per position, -1 where the position is another
    rank's), restated from vllm/v1/worker/block_table.py by the Go test
    that writes it: Layout.local_slot gives the owner exactly that slot and
    every other rank pads."""
    cases = json.loads(VLLM_SLOTS.read_text())
    assert len(cases) >= 10 and any(c["dcp"] > 1 and c["interleave"] > 1 for c in cases)
    for c in cases:
        lay = dcp.Layout(tp=c["dcp"], dcp=c["dcp"], interleave=c["interleave"])
        for pos in range(len(c["slots"][0])):
            r, slot = lay.local_slot(pos, c["block_size"], c["table"])
            assert r == lay.owner(pos, c["block_size"])
            got = [c["slots"][q][pos] for q in range(c["dcp"])]
            assert got == [slot if q == r else -1 for q in range(c["dcp"])], (c["dcp"], c["interleave"], pos)


def test_local_slot_rejects_positions_outside_the_table():
    lay = dcp.Layout(tp=2, dcp=2, interleave=2)
    with pytest.raises(GeometryError, match="needs virtual block 2, block table has 2"):
        lay.local_slot(16, 4, [5, 9])
    with pytest.raises(GeometryError, match="negative"):
        lay.local_slot(-1, 4, [5, 9])
    assert [lay.dcp_rank(t) for t in range(4)] == [0, 1, 0, 1]


def test_join_hashes_is_each_hashs_bytes_in_order():
    """join_hashes (the binary begin's, lookup's and plan's hash column)
    reads the hashes' slot where it can and bytes() otherwise: the same
    bytes either way, in the list's order."""
    hs = [dcp.ChunkHash(bytes([i]) * 16) for i in range(1, 40)]
    assert dcp.join_hashes(hs) == b"".join(bytes(h) for h in hs) and len(dcp.join_hashes(hs)) == 16 * 39
    assert dcp.join_hashes([]) == b""

    class Raw:  # not a _Hash16: only its bytes()
        def __init__(self, b: bytes) -> None:
            self.b = b

        def __bytes__(self) -> bytes:
            return self.b

    mixed = [hs[0], Raw(bytes(range(16))), hs[2]]
    assert dcp.join_hashes(mixed) == bytes(hs[0]) + bytes(range(16)) + bytes(hs[2])  # type: ignore[list-item]
    # an iterator is read once: the fallback must not join what the first pass left
    assert dcp.join_hashes(iter(mixed)) == dcp.join_hashes(mixed)  # type: ignore[arg-type]
