"""The Go encoder's bytes (wire/testdata/golden) decode and re-encode to
exactly themselves in Python, and Python derives the same identity."""

import contextlib
import json
import pathlib

import pytest

from kvtier import cuda, dcp, wire
from kvtier.errors import MalformedError

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "wire" / "testdata" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())

CLASSES: dict[str, type] = {
    "Spec": dcp.Spec,
    "MemHandle": cuda.MemHandle,
    "EventHandle": cuda.EventHandle,
}
for name in ("RegisterRequest", "RegisterReply", "StoreRequest", "StoreReply", "RetrieveRequest",
             "RetrieveReply", "LookupRequest", "LookupReply", "RestoreBeginRequest", "RestorePlan",
             "RestoreReport", "RestoreWait", "RestoreVerdict", "ReportAck", "EventAck", "Heartbeat",
             "BlocksFreed"):
    CLASSES[name] = getattr(wire, name)

JSON_CASES = sorted(f for f, t in MANIFEST.items() if f.endswith(".json") and t in CLASSES)


def test_manifest_is_fully_covered():
    handled = set(JSON_CASES) | {"batch.bin", "identity.json", "identity_pp.json", "reply_ok.json", "reply_error.json",
                                 "subjects.json"}
    assert set(MANIFEST) == handled, "a golden vector has no Python check"


@pytest.mark.parametrize("name", JSON_CASES)
def test_decode_encode_is_identity(name):
    data = (GOLDEN / name).read_bytes()
    msg = wire.decode(CLASSES[MANIFEST[name]], data)
    assert wire.encode(msg) == data


def test_store_request_fields():
    msg = wire.decode(wire.StoreRequest, (GOLDEN / "store_request.json").read_bytes())
    assert msg.request_id == "req-1/<prompt>&co"
    assert msg.chunks[1].blocks == [[2198, 1 << 40], [3]]
    assert msg.chunks[0].blocks[1] == []
    assert msg.event.raw == bytes([0xA5, 0x01]) * 32


def test_new_fields_decode():
    v = wire.decode(wire.RestoreVerdict, (GOLDEN / "restore_verdict_refused.json").read_bytes())
    v.validate()
    assert (v.state, v.prefix, v.reason) == (wire.VERDICT_REFUSED, 0, "reader engine0/2 is not alive")
    bad = wire.RestoreVerdict("r", wire.VERDICT_COMPLETE, 1, reason="x")
    with pytest.raises(MalformedError):
        bad.validate()
    f = wire.decode(wire.BlocksFreed, (GOLDEN / "blocks_freed.json").read_bytes())
    assert (f.rank, f.request_id, len(f.chunks)) == (wire.Rank("engine0", 1), "req-1", 2)
    assert wire.Subjects().freed(f.rank) == "kvtier.rank.engine0.1.freed"


def test_subjects_equal_go():
    """Every subject Python builds is Go's (scoped coordinator subjects, C9)."""
    want = json.loads((GOLDEN / "subjects.json").read_text())
    s, r = wire.Subjects("kv"), wire.Rank("engine0", 3)
    got = {"freed": s.freed(r), "events": s.events(r), "heartbeat": s.heartbeat(r),
           "inventory": s.inventory(r), "report": s.report(r), "coord.unscoped.lookup": s.coord(wire.COORD_LOOKUP)}
    for op in (wire.OP_REGISTER, wire.OP_STORE, wire.OP_RETRIEVE, wire.OP_RELEASE, wire.OP_STATUS):
        got["engine." + op] = s.engine(r, op)
    for op in (wire.COORD_REGISTER, wire.COORD_LOOKUP, wire.COORD_RESTORE_BEGIN, wire.COORD_RESTORE_WAIT,
               wire.COORD_RESTORE_CANCEL):
        got["coord." + op] = s.engine_coord("engine0", op)
    assert got == want


def test_plan_decoder():
    plan = wire.decode_restore_plan(wire.encode_reply(
        ok=wire.decode(wire.RestorePlan, (GOLDEN / "restore_plan.json").read_bytes())))
    assert sorted(plan.ranks) == ["engine0/0", "engine0/1", "engine0/10"]
    assert plan.ranks["engine0/0"][0].sum == 0xFEDCBA9876543210
    assert plan.ranks["engine0/0"][0].source.tier == wire.Tier.L2
    assert plan.ranks["engine0/0"][1].key.group == 1


def test_reply_envelopes():
    ok = (GOLDEN / "reply_ok.json").read_bytes()
    assert wire.decode_reply(wire.StoreReply, ok).stored == 1
    assert wire.encode_reply(ok=wire.StoreReply(stored=1)) == ok
    err = (GOLDEN / "reply_error.json").read_bytes()
    from kvtier import errors

    with pytest.raises(errors.Geometry) as ei:
        wire.decode_reply(wire.StoreReply, err, "kvtier.rank.e.0.engine.store")
    assert ei.value.code == "geometry"
    assert "177408" in ei.value.message
    assert wire.encode_reply(error=wire.Error(ei.value.code, ei.value.message)) == err


def test_batch_binary():
    data = (GOLDEN / "batch.bin").read_bytes()
    b = wire.Batch.from_binary(data)
    assert b.rank == wire.Rank("engine0", 3)
    assert b.incarnation == 1700000000000000001
    assert [e.seq for e in b.events] == [1, 2]
    assert b.events[0].sum == 0xDEADBEEFCAFEF00D
    assert b.events[1].size == 1 << 40
    assert b.events[0].key.shard == 3
    assert b.to_binary() == data


@pytest.mark.parametrize("cut", ["empty", "magic", "truncated", "extra", "kind", "tier", "keyver"])
def test_batch_rejects_malformed(cut):
    p = bytearray((GOLDEN / "batch.bin").read_bytes())
    ev0 = 5 + len("engine0") + 16
    q = {
        "empty": b"",
        "magic": b"XXXX" + p[4:],
        "truncated": p[:-1],
        "extra": p + b"\0",
        "kind": p[:ev0 + 8] + b"\x07" + p[ev0 + 9:],
        "tier": p[:ev0 + 9] + b"\x00" + p[ev0 + 10:],
        "keyver": p[:ev0 + 10] + b"\x02" + p[ev0 + 11:],
    }[cut]
    with pytest.raises(MalformedError):
        wire.Batch.from_binary(bytes(q))


@pytest.mark.parametrize("name", ["identity.json", "identity_pp.json"])
def test_identity_matches_go(name):
    g = json.loads((GOLDEN / name).read_bytes())
    spec = wire.decode(dcp.Spec, json.dumps(g["spec"]))
    assert (spec.layout.pp, spec.layout.pp_stage) == ((3, 2) if name == "identity_pp.json" else (1, 0))
    r = spec.resolve()
    assert r.fingerprint.hex() == g["fingerprint"]
    assert str(r.namespace) == g["namespace"]
    assert r.scheduler_block == g["scheduler_block"]
    hashes = r.chunk_hashes(g["tokens"])
    assert [str(h) for h in hashes] == g["chunks"]
    assert len(hashes) == 2  # the partial third chunk gets no hash
    k = dcp.Key.parse(g["key_text"])
    assert k.to_binary().hex() == g["key_binary"]
    assert dcp.Key.from_binary(bytes.fromhex(g["key_binary"])) == k
    assert str(k) == g["key_text"]


def _golden_ns() -> dcp.Namespace:
    return dcp.Namespace(bytes(0xF0 + i for i in range(16)))


def _golden_chunk(seed: int) -> dcp.ChunkHash:
    return dcp.ChunkHash(bytes(seed ^ ((i * 17) & 0xFF) for i in range(16)))


def test_python_built_messages_equal_go_bytes():
    """What Python sends, built from scratch, is byte for byte what Go sends."""
    ns = _golden_ns()
    ev = cuda.EventHandle("cuda", "GPU-5e1c0d2a-7f7e-4a8e-9c1b-0123456789ab", bytes([0xA5, 0x01]) * 32)
    store = wire.StoreRequest("req-1/<prompt>&co", ns, "5e5510a1d00000000000000000c0ffee", [
        wire.ChunkBlocks(_golden_chunk(1), [[7, 8, 9, 10], []]),
        wire.ChunkBlocks(_golden_chunk(2), [[2198, 1 << 40], [3]]),
    ], ev)
    assert wire.encode(store) == (GOLDEN / "store_request.json").read_bytes()
    store_pos = wire.StoreRequest("req-2", ns, "5e5510a1d00000000000000000c0ffee", [
        wire.ChunkBlocks(_golden_chunk(3), [[11, 12, 13, 14], []], pos=5),
        wire.ChunkBlocks(_golden_chunk(4), [[1], [2]]),
        wire.ChunkBlocks(_golden_chunk(5), [[], []], pos=0xFFFFFFFF),
    ], ev)
    assert wire.encode(store_pos) == (GOLDEN / "store_request_pos.json").read_bytes()
    assert store_pos.to_binary() == (COMPACT / "store_request_pos.bin").read_bytes()
    lookup = wire.LookupRequest(ns, [_golden_chunk(0), _golden_chunk(1)], "engine0", True)
    assert wire.encode(lookup) == (GOLDEN / "lookup_request.json").read_bytes()
    begin = wire.RestoreBeginRequest(wire.RestoreBegin(ns, [_golden_chunk(0)], 10000), "engine0")
    assert wire.encode(begin) == (GOLDEN / "restore_begin_request.json").read_bytes()
    assert wire.encode(wire.RestoreWait("r-00000001")) == (GOLDEN / "restore_wait.json").read_bytes()


@pytest.mark.parametrize("name", JSON_CASES)
def test_mutated_vectors_raise_only_malformed(name):
    """Decoding corrupted input raises MalformedError (or decodes), never
    anything else."""
    import random

    data = (GOLDEN / name).read_bytes()
    rng = random.Random(name)
    for _ in range(200):
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(3)
            i = rng.randrange(len(b))
            if op == 0:
                b[i] = rng.randrange(256)
            elif op == 1:
                del b[i:i + rng.randrange(1, 8)]
            else:
                b[i:i] = rng.choice([b'"', b"-1", b"null", b"[", b"{}", b"1e400", b"true"])
        with contextlib.suppress(MalformedError):
            wire.decode(CLASSES[MANIFEST[name]], bytes(b))


COMPACT = GOLDEN.parent / "compact"


@pytest.mark.parametrize("name,cls", [("store_request", wire.StoreRequest), ("store_request_pos", wire.StoreRequest),
                                      ("retrieve_request", wire.RetrieveRequest),
                                      ("retrieve_request_skip", wire.RetrieveRequest),
                                      ("lookup_request", wire.LookupRequest)])
def test_binary_requests_equal_go_bytes(name, cls):
    """The binary store, retrieve and lookup requests (KVS1, KVS2 with
    chunk positions, KVR1, KVR2 with skipped blocks, KVL1) Python encodes
    are Go's bytes for the same golden value (wire/testdata/compact); a
    binary retrieve request decodes back to that value."""
    msg = wire.decode(cls, (GOLDEN / f"{name}.json").read_bytes())
    data = (COMPACT / f"{name}.bin").read_bytes()
    assert msg.to_binary() == data
    if cls is wire.RetrieveRequest:
        assert wire.RetrieveRequest.from_binary(data) == msg
        for n in range(len(data)):
            with pytest.raises(MalformedError):
                wire.RetrieveRequest.from_binary(data[:n])


def test_binary_begin_equals_go_bytes():
    """The binary restore.begin (KVG1) Python encodes is Go's for the
    golden value, whose JSON Python encodes as Go does too."""
    from kvtier import client_plan

    v = json.loads((COMPACT / "restore_begin_request.json").read_bytes())
    req = client_plan.RestoreBeginBinary(
        wire.RestoreBegin(dcp.Namespace.parse(v["namespace"]), [dcp.ChunkHash.parse(h) for h in v["chunks"]],
                          v["deadline_ms"]), v["instance"], v["plan_encoding"], v["state_at_end"], v["lookup"])
    assert req.to_binary() == (COMPACT / "restore_begin_request.bin").read_bytes()
    assert wire.encode(req) == (COMPACT / "restore_begin_request.json").read_bytes()


def test_binary_requests_pick_the_block_width():
    ns = _golden_ns()
    item = wire.RetrieveItem(0, 0, dcp.Key(ns, _golden_chunk(0), 1, 0), 7,
                             wire.Source(wire.Rank("e", 1), wire.Tier.L1), [0, 0xFFFFFFFF])
    small = wire.RetrieveRequest("r", ns, "s", [item]).to_binary()
    assert small[:5] == b"KVR1\x04" and small.endswith(b"\x00\x00\x00\x00\xff\xff\xff\xff")
    item.blocks = [1 << 32]
    big = wire.RetrieveRequest("r", ns, "s", [item]).to_binary()
    assert big[:5] == b"KVR1\x08" and big.endswith(b"\x00\x00\x00\x01\x00\x00\x00\x00")
    # Two items of one chunk and one holder share the tables: 27 B more.
    two = wire.RetrieveRequest("r", ns, "s", [item, item]).to_binary()
    assert len(two) == len(big) + 27 + 8


def test_retrieve_skips_pick_the_version():
    """KVR1 while no item skips blocks (a rankd from before skips reads it),
    KVR2 with a u32 after each item once one does; the JSON field is left
    out at 0, so such a request is what an older rankd accepts."""
    ns = _golden_ns()
    items = [wire.RetrieveItem(c, 0, dcp.Key(ns, _golden_chunk(c), 0, 0), 7,
                               wire.Source(wire.Rank("e", 0), wire.Tier.L1), [c + 1]) for c in range(2)]
    v1 = wire.RetrieveRequest("r", ns, "s", items).to_binary()
    assert v1[:4] == b"KVR1" and b'"skip"' not in wire.encode(wire.RetrieveRequest("r", ns, "s", items))
    items[0].skip = 3
    v2 = wire.RetrieveRequest("r", ns, "s", items).to_binary()
    assert v2[:4] == b"KVR2" and len(v2) == len(v1) + 4 * len(items)
    assert b'"skip":3' in wire.encode(wire.RetrieveRequest("r", ns, "s", items))
    items[0].skip = -1
    with pytest.raises(MalformedError, match="skips"):
        wire.RetrieveRequest("r", ns, "s", items).to_binary()


def test_store_request_positions_pick_the_version():
    """KVS1 while every position is 0 (a rankd from before positions reads
    it), KVS2 with a u32 after each chunk hash once one is not."""
    ns = _golden_ns()
    ev = cuda.EventHandle("host", "d", b"x")
    chunks = [wire.ChunkBlocks(_golden_chunk(1), [[1]]), wire.ChunkBlocks(_golden_chunk(2), [[2]])]
    v1 = wire.StoreRequest("r", ns, "s", chunks, ev).to_binary()
    assert v1[:4] == b"KVS1"
    chunks[1].pos = 1
    v2 = wire.StoreRequest("r", ns, "s", chunks, ev).to_binary()
    assert v2[:4] == b"KVS2" and len(v2) == len(v1) + 4 * len(chunks)
    chunks[1].pos = 1 << 32
    with pytest.raises(MalformedError, match="position"):
        wire.StoreRequest("r", ns, "s", chunks, ev).to_binary()


@pytest.mark.parametrize("case", ["negative block", "other namespace", "group mismatch", "holder tp rank",
                                  "long session"])
def test_binary_requests_refuse_what_they_cannot_carry(case):
    ns = _golden_ns()
    item = wire.RetrieveItem(0, 1, dcp.Key(ns, _golden_chunk(0), 0, 1), 0, wire.Source(wire.Rank("e", 0), 1), [3])
    req = wire.RetrieveRequest("r", ns, "s", [item])
    if case == "negative block":
        store = wire.StoreRequest("r", ns, "s", [wire.ChunkBlocks(_golden_chunk(1), [[1, -2]])],
                                  cuda.EventHandle("host", "d", b"x"))
        with pytest.raises(MalformedError, match="block id -2 is negative"):
            store.to_binary()
        return
    if case == "other namespace":
        item.key = dcp.Key(dcp.Namespace(bytes([9] * 16)), _golden_chunk(0), 0, 1)
    elif case == "group mismatch":
        item.group = 0
    elif case == "holder tp rank":
        item.source = wire.Source(wire.Rank("e", 70000), 1)
    else:
        req.session = "s" * 256
    with pytest.raises(MalformedError):
        req.to_binary()


def test_headers_match_go():
    """The NATS header names and the least pace the Python client sends are
    the Go daemons' (a name that drifted would be ignored by the rankd:
    no deadline, no pace)."""
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    go = (root / "wire" / "deadline.go").read_text() + (root / "wire" / "protocol.go").read_text()
    for go_name, py in (("HeaderDeadline", wire.HEADER_DEADLINE), ("HeaderGatherLimit", wire.HEADER_GATHER_LIMIT),
                        ("HeaderPace", wire.HEADER_PACE), ("HeaderResults", wire.HEADER_RESULTS)):
        m = re.search(rf'^const {go_name} = "([^"]+)"$', go, re.M)
        assert m is not None, go_name
        assert m.group(1) == py, (go_name, m.group(1), py)
    m = re.search(r"^const MinPace = (\d+) << (\d+)$", (root / "transfer" / "retrieve.go").read_text(), re.M)
    assert m is not None and int(m.group(1)) << int(m.group(2)) == wire.MIN_PACE
