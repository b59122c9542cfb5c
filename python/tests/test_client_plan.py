"""The client's fast decoders: the binary restore plan (kvtier.client_plan)
against Go's bytes, and the retrieve reply against the generic decoder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import random

import pytest

from kvtier import client, client_plan, dcp, wire
from kvtier.errors import BadRequest, MalformedError

COMPACT = pathlib.Path(__file__).resolve().parents[2] / "wire" / "testdata" / "compact"


def _golden() -> tuple[bytes, list[dcp.ChunkHash], wire.RestorePlan]:
    chunks = [dcp.ChunkHash.parse(h) for h in json.loads((COMPACT / "chunks.json").read_text())]
    want = wire.decode(wire.RestorePlan, (COMPACT / "restore_plan.json").read_bytes())
    return (COMPACT / "restore_plan.bin").read_bytes(), chunks, want


def test_binary_plan_equals_go_json_plan():
    """Go's binary encoding of the golden plan decodes to exactly the
    plan its JSON form decodes to (wire/testdata/compact)."""
    data, chunks, want = _golden()
    assert client_plan.is_binary_plan(data)
    got = client_plan.decode_plan(data, chunks)
    assert got == want
    assert sum(len(v) for v in got.ranks.values()) > 2  # several items, several readers or groups
    # An error reply is JSON and raises its error; a JSON plan decodes too.
    assert client_plan.decode_plan(b'{"ok":' + (COMPACT / "restore_plan.json").read_bytes() + b"}", chunks) == want
    with pytest.raises(BadRequest, match="no such"):
        client_plan.decode_plan(b'{"error":{"code":"bad_request","message":"no such"}}', chunks)


def test_binary_plan_last_only_equals_go_json_plan():
    """A restore.begin with state_at_end: Go's KVP2 plan (a recurrent
    group's object for the last chunk only) decodes to exactly its JSON
    form's plan; truncations and bad flags raise MalformedError."""
    chunks = [dcp.ChunkHash.parse(h) for h in json.loads((COMPACT / "chunks.json").read_text())]
    want = wire.decode(wire.RestorePlan, (COMPACT / "restore_plan_last.json").read_bytes())
    data = (COMPACT / "restore_plan_last.bin").read_bytes()
    assert data[:4] == b"KVP2" and client_plan.is_binary_plan(data)
    got = client_plan.decode_plan(data, chunks)
    assert got == want
    assert [(it.chunk, it.group) for it in got.ranks["engine0/0"]] == [(0, 1), (1, 0), (1, 1)]
    for n in range(len(data)):
        with pytest.raises(MalformedError):
            client_plan.decode_plan_binary(data[:n], chunks)
    # engine0/0's expectations follow its rank (u8 7, "engine0", u16 0) and their count (u16 2)
    off = data.index(b"\x07engine0\x00\x00\x00\x02") + 12
    assert data[off + 4] == 1 and data[off + 9] == 0, data[off:off + 10].hex()
    for pos, flag, words in ((off + 4, 2, "last-only flag 2"), (off + 9, 1, "every one")):
        b = bytearray(data)
        b[pos] = flag
        with pytest.raises(MalformedError, match=words):
            client_plan.decode_plan_binary(bytes(b), chunks)


def test_binary_plan_refuses_bad_input():
    """Truncated, extended, out-of-range and corrupted plans raise
    MalformedError, never another exception."""
    data, chunks, _ = _golden()
    for n in range(len(data)):
        with pytest.raises(MalformedError):
            client_plan.decode_plan_binary(data[:n], chunks)
    with pytest.raises(MalformedError, match="after the last reader"):
        client_plan.decode_plan_binary(data + b"\x00", chunks)
    with pytest.raises(MalformedError, match="exceeds the"):
        client_plan.decode_plan_binary(data, chunks[:1])
    rng = random.Random(7)
    for _ in range(2000):
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(4, len(b))] = rng.randrange(256)
        with contextlib.suppress(MalformedError):
            client_plan.decode_plan_binary(bytes(b), chunks)


GOLDEN = COMPACT.parent / "golden"


def _both(data: bytes) -> tuple[object, object]:
    """What the fast and the generic retrieve-reply decoders make of data:
    the reply, or the exception's type."""
    out = []
    for f in (client.decode_retrieve_reply, lambda d: wire.decode_reply(wire.RetrieveReply, d)):
        try:
            out.append(f(data))
        except Exception as e:  # compared by type
            out.append(type(e))
    return out[0], out[1]


def test_retrieve_reply_fast_path_equals_the_generic_decoder():
    """The fast retrieve-reply decoder answers exactly what the generic
    one does (reply or error type) for Go's golden reply, edge cases and
    thousands of mutations of it."""
    golden = b'{"ok":' + (GOLDEN / "retrieve_reply.json").read_bytes().strip() + b"}"
    fast, slow = _both(golden)
    assert isinstance(fast, wire.RetrieveReply) and fast == slow and len(fast.results) == 2
    cases = [b'{"ok":{"results":null}}', b'{"ok":{}}', b'{"ok":{"results":[{"chunk":1}]}}',
             b'{"ok":{"results":[{"chunk":true,"group":0,"ok":true,"sum":1}]}}',
             b'{"ok":{"results":[{"chunk":0,"group":0,"ok":1,"sum":1}]}}',
             b'{"ok":{"results":[{"chunk":0,"group":0,"ok":true,"sum":-1}]}}',
             b'{"ok":{"results":[{"chunk":0,"group":0,"ok":true,"sum":18446744073709551616}]}}',
             b'{"ok":{"results":[{"chunk":0,"group":0,"ok":true,"sum":1,"reason":null}]}}',
             b'{"ok":{"results":[{"chunk":0,"group":0,"ok":true,"sum":1.0}]}}',
             b'{"ok":{"results":[7]}}', b'{"error":{"code":"unavailable","message":"m"}}',
             b'{"error":null,"ok":{"results":[]}}', b"[]", b"\xff", b""]
    rng = random.Random(11)
    for _ in range(3000):
        b = bytearray(golden)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            if rng.random() < 0.5:
                b[i] = rng.choice(b'0129-.,:{}[]"etrufalsn ')
            else:
                b[i:i] = rng.choice([b'"', b"-1", b"null", b"[", b"{}", b"true", b"1.5", b"99999999999999999999"])
        cases.append(bytes(b))
    fast_hits = 0
    for data in cases:
        fast, slow = _both(data)
        assert fast == slow, data
        fast_hits += isinstance(fast, wire.RetrieveReply)
    assert fast_hits > 100  # the mutations leave many valid replies


def _golden_packed() -> list[tuple[client_plan.PlanItems, list[wire.RetrieveItem]]]:
    """Every reader of both golden plans (KVP1, KVP2) as PlanItems, beside
    its items as the JSON plan lists them."""
    chunks = [dcp.ChunkHash.parse(h) for h in json.loads((COMPACT / "chunks.json").read_text())]
    out = []
    for name in ("restore_plan", "restore_plan_last"):
        want = wire.decode(wire.RestorePlan, (COMPACT / f"{name}.json").read_bytes())
        got = client_plan.decode_plan_packed((COMPACT / f"{name}.bin").read_bytes(), chunks)
        assert (got.restore_id, got.prefix, got.reason, sorted(got.ranks)) == (
            want.restore_id, want.prefix, want.reason, sorted(want.ranks))
        out += [(got.ranks[r], want.ranks[r]) for r in sorted(want.ranks)]
    return out


def test_plan_items_are_the_plans_items():
    """A plan decoded packed holds every reader's items exactly (items()
    equals Go's JSON plan); the form the scheduler hands its workers
    (to_bytes, KVW1) comes back equal, and PlanItems.of packs a plan's
    items back to the same value; of refuses items of another shape."""
    cases = _golden_packed()
    assert any(any(last for _, _, last in pl.exps) for pl, _ in cases)  # the KVP2 plan's last-only state
    for pl, items in cases:
        assert pl.items() == items and len(pl) == len(items)
        assert client_plan.PlanItems.from_bytes(pl.to_bytes()) == pl
        again = client_plan.PlanItems.of(items)
        assert again.items() == items and again.exps == pl.exps and again.hashes == pl.hashes
    assert client_plan.PlanItems.from_bytes(client_plan.PlanItems.of([]).to_bytes()).items() == []
    pl, items = max(cases, key=lambda c: len(c[1]))
    assert len({it.chunk for it in items}) > 1 and len({it.group for it in items}) > 1
    ns2 = dataclasses.replace(items[1].key, ns=dcp.Namespace(bytes(16)))
    for bad in ([dataclasses.replace(items[0], blocks=[3]), *items[1:]],
                [dataclasses.replace(items[0], skip=1), *items[1:]],
                [dataclasses.replace(items[0], group=items[0].group + 1), *items[1:]],  # its key's group differs
                [items[0], dataclasses.replace(items[1], key=ns2), *items[2:]],
                [dataclasses.replace(it, chunk=2) if it.chunk == 1 else it for it in items],  # a gap
                items[:-1],  # the last chunk short of an object the first has
                [items[0], dataclasses.replace(items[1], chunk=items[1].chunk + 5), *items[2:]],
                [*items[:-1], dataclasses.replace(items[-1], chunk=1 << 40)],  # sized by the items, not the number
                [dataclasses.replace(it, chunk=-1) for it in items]):
        with pytest.raises(ValueError):
            client_plan.PlanItems.of(bad)


def test_plan_items_refuse_bad_input():
    """The packed form's truncations, trailing bytes, and out-of-range
    holder, tier and flag bytes raise MalformedError, never another
    exception."""
    pl, _ = max(_golden_packed(), key=lambda c: len(c[1]))
    data = pl.to_bytes()
    for n in range(len(data)):
        with pytest.raises(MalformedError):
            client_plan.PlanItems.from_bytes(data[:n])
    with pytest.raises(MalformedError, match="bytes of items"):
        client_plan.PlanItems.from_bytes(data + b"\x00")
    # the last item: (u64 sum | u16 holder | u8 tier)
    for pos, value, words in ((len(data) - 1, 9, "tier 9"), (len(data) - 2, 7, "holder index"),
                              (len(data) - 3, 1, "holder index")):
        b = bytearray(data)
        b[pos] = value
        with pytest.raises(MalformedError, match=words):
            client_plan.PlanItems.from_bytes(bytes(b))
    e = data.index(len(pl.exps).to_bytes(2, "big") + pl.exps[0][0].to_bytes(2, "big"))
    b = bytearray(data)
    b[e + 6] = 2  # the first expectation's last-only flag
    with pytest.raises(MalformedError, match="last-only flag 2"):
        client_plan.PlanItems.from_bytes(bytes(b))


def _random_plan_items(rng: random.Random) -> client_plan.PlanItems:
    ns = dcp.Namespace(rng.randbytes(16))
    holders = [wire.Rank(rng.choice(["engine0", "peer-b", "x"]), rng.randrange(4)) for _ in range(rng.randint(1, 3))]
    holders = list(dict.fromkeys(holders))
    exps = [(g, rng.randrange(3), rng.random() < 0.3) for g in rng.sample(range(3), rng.randint(1, 3))]
    if all(last for _, _, last in exps):
        exps[0] = (exps[0][0], exps[0][1], False)
    n = rng.randint(0, 6)
    inner = sum(1 for e in exps if not e[2])
    items = (n - 1) * inner + len(exps) if n else 0
    recs = b"".join(client_plan._ITEM.pack(rng.getrandbits(64), rng.randrange(len(holders)),
                                           rng.choice(list(wire.Tier))) for _ in range(items))
    return client_plan.PlanItems(ns, holders, exps, b"".join(rng.randbytes(16) for _ in range(n)), recs)


def test_retrieve_request_is_the_encoders():
    """The worker's retrieve request written from packed items is, byte
    for byte, what wire.RetrieveRequest.to_binary encodes for the same
    items with their blocks set by the documented rule (chunk 0 skipping
    the engine's own blocks), over random plans: several groups and
    holders, last-only states, blocks past 32 bits; from_binary decodes it
    back to those items; holding finds exactly the items with a block."""
    rng = random.Random(11)
    kinds = set()
    for _ in range(400):
        pl = _random_plan_items(rng)
        first = rng.randrange(3)
        bpc = [rng.randint(1, 3) for _ in range(3)]
        skip = [rng.randrange(b) for b in bpc] if rng.random() < 0.4 else []
        top = 1 << 40 if rng.random() < 0.2 else 1000
        ids = [[rng.randrange(top) for _ in range((first + pl.prefix) * b)] for b in bpc]
        items = pl.items()
        for it in items:
            lo = (first + it.chunk) * bpc[it.group]
            it.skip = skip[it.group] if skip and it.chunk == 0 else 0
            it.blocks = ids[it.group][lo + it.skip:lo + bpc[it.group]]
        want = wire.RetrieveRequest("r-1", pl.namespace, "sess", items)
        got = pl.retrieve_request("r-1", "sess", ids, bpc, first, skip)
        assert got == want.to_binary()
        assert wire.RetrieveRequest.from_binary(got) == want
        kinds.add(got[:5])
        probe = rng.choice([b for it in items for b in it.blocks] or [7])
        assert pl.holding(probe, ids, bpc, first, skip) == sorted({(it.group, it.chunk) for it in items
                                                                    if probe in it.blocks})
    assert kinds == {b"KVR1\x04", b"KVR2\x04", b"KVR1\x08", b"KVR2\x08"}
    pl = _random_plan_items(random.Random(3))
    assert pl.prefix > 0
    with pytest.raises(ValueError, match="block ids, want"):
        pl.retrieve_request("r", "s", [[1], [1], [1]], [2, 2, 2])


def test_retrieve_request_by_columns_is_by_items():
    """The column-wise retrieve request (plans whose chunks all have the
    same objects) is byte for byte the item-by-item one, over random
    plans of one to four objects a chunk, equal and unequal blocks per
    chunk, skips, several holders renumbered in order of first use, block
    ids past 32 bits, rows as lists, tuples and arrays; and it gives up
    (None, so the caller goes item by item and names the fault) for short
    block tables, negative ids and holder indexes past the holders."""
    from array import array

    rng = random.Random(29)
    for trial in range(600):
        ns = dcp.Namespace(rng.randbytes(16))
        holders = list(dict.fromkeys(wire.Rank(rng.choice(["engine0", "peer"]), rng.randrange(3))
                                     for _ in range(rng.randint(1, 3))))
        per = rng.randint(1, 4)
        exps = [(g, rng.randrange(3), False) for g in rng.sample(range(6), per)]
        n = rng.randint(1, 40)
        recs = b"".join(client_plan._ITEM.pack(rng.getrandbits(64), rng.randrange(len(holders)),
                                               rng.choice(list(wire.Tier))) for _ in range(n * per))
        pl = client_plan.PlanItems(ns, holders, exps, rng.randbytes(16 * n), recs)
        first = rng.randrange(3)
        same = rng.random() < 0.6
        b0 = rng.randint(1, 4)
        bpc = [b0 if same else rng.randint(1, 4) for _ in range(6)]
        skip = [rng.randrange(b + 1) for b in bpc] if rng.random() < 0.5 else []
        top = 1 << 40 if rng.random() < 0.3 else 5000
        kind = rng.choice([list, tuple, lambda v: array("Q", v)])
        ids = [kind([rng.randrange(top) for _ in range((first + n) * b)]) for b in bpc]
        want = pl._request_by_items("rid", "sess", ids, bpc, first, skip)
        got = pl._request_by_columns("rid", "sess", ids, bpc, first, skip)
        assert got == want, trial
        assert pl.retrieve_request("rid", "sess", ids, bpc, first, skip) == want
    # a plan with a last-only object goes item by item
    last = client_plan.PlanItems(dcp.Namespace(bytes(16)), [wire.Rank("e", 0)], [(0, 0, False), (1, 0, True)],
                                 bytes(32), client_plan._ITEM.pack(1, 0, 1) * 3)
    assert last._request_by_columns("r", "s", [[1, 2], [3, 4]], [1, 1], 0, ()) is None
    assert last.retrieve_request("r", "s", [[1, 2], [3, 4]], [1, 1]) == \
        last._request_by_items("r", "s", [[1, 2], [3, 4]], [1, 1], 0, ())
    one = client_plan.PlanItems(dcp.Namespace(bytes(16)), [wire.Rank("e", 0)], [(0, 0, False)], bytes(32),
                                client_plan._ITEM.pack(1, 0, 1) * 2)
    for rows, bpc in (([[1]], [1]), ([[1, -2]], [1]), ([[1, 2, 3]], [2])):
        assert one._request_by_columns("r", "s", rows, bpc, 0, ()) is None
        with pytest.raises(ValueError):
            one.retrieve_request("r", "s", rows, bpc)
    # a block table keyed by group: the same bytes; a group it lacks raises as item by item does
    assert one.retrieve_request("r", "s", {0: [5, 6]}, [1]) == one._request_by_items("r", "s", [[5, 6]], [1], 0, ())
    assert one._request_by_columns("r", "s", {1: [5, 6]}, [1], 0, ()) is None
    with pytest.raises(KeyError):
        one.retrieve_request("r", "s", {1: [5, 6]}, [1])
    bad_holder = client_plan.PlanItems(dcp.Namespace(bytes(16)), [wire.Rank("e", 0)], [(0, 0, False)], bytes(16),
                                       client_plan._ITEM.pack(1, 1, 1))
    assert bad_holder._request_by_columns("r", "s", [[1]], [1], 0, ()) is None


def test_retrieve_reply_check():
    """retrieve_packed does not decode a reply's results, but an error
    reply still raises its error, and a reply that is not the rankd's
    shape raises MalformedError."""
    assert client._check_retrieve_reply(b'{"ok":{"results":[{"chunk":0,"group":0,"ok":false,"sum":1}]}}') is None
    with pytest.raises(BadRequest, match="no such"):
        client._check_retrieve_reply(b'{"error":{"code":"bad_request","message":"no such"}}')
    for bad in (b"", b"nope", b'{"ok":[]}'):
        with pytest.raises(MalformedError):
            client._check_retrieve_reply(bad)
