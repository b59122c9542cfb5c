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


def _plan_items() -> list[wire.RetrieveItem]:
    """A rank's items of a plan: two groups, a skip in chunk 0, holders of
    two instances, every tier, chunk 2 absent (a gap)."""
    ns = dcp.Namespace(bytes(range(16)))
    h = [dcp.ChunkHash(bytes([c + 1]) * 16) for c in range(5)]
    out = []
    for c in (0, 1, 3, 4):
        for g in (0, 1):
            holder = wire.Rank("engine0" if (c + g) % 2 else "peer-b", (c * 2 + g) % 3)
            out.append(wire.RetrieveItem(c, g, dcp.Key(ns, h[c], 2 + g, g), 0xFEDCBA9876543210 - c * 7 - g,
                                         wire.Source(holder, list(wire.Tier)[(c + g) % len(wire.Tier)]),
                                         skip=1 if c == 0 else 0))
    return out


def test_packed_items_round_trip():
    """What the connector's scheduler hands its workers: pack_items then
    unpack_items gives back every field of every item, in order; items the
    form cannot carry are refused when packed."""
    items = _plan_items()
    data = client_plan.pack_items(items)
    assert client_plan.unpack_items(data) == items
    assert client_plan.unpack_items(client_plan.pack_items([])) == []
    ns2 = dataclasses.replace(items[1], key=dataclasses.replace(items[1].key, ns=dcp.Namespace(bytes(16))))
    for bad in (dataclasses.replace(items[0], blocks=[3]),
                dataclasses.replace(items[0], group=1),  # its key is of group 0
                dataclasses.replace(items[0], key=dataclasses.replace(items[0].key, chunk=items[2].key.chunk)),
                ns2):
        with pytest.raises(ValueError):
            client_plan.pack_items([items[0], *items[1:], bad] if bad is not ns2 else [items[0], bad])


def test_packed_items_refuse_bad_input():
    data = client_plan.pack_items(_plan_items())
    for n in range(len(data)):
        with pytest.raises(MalformedError):
            client_plan.unpack_items(data[:n])
    with pytest.raises(MalformedError, match="left"):
        client_plan.unpack_items(data + b"\x00")
    # the last item: its tier, then its holder index, then its chunk
    tail = len(data) - 4  # the skip's u32
    for pos, value, words in ((tail - 1, 9, "tier 9"), (tail - 2, 7, "holder 7"), (len(data) - 20, 9, "chunk 9 of 5")):
        b = bytearray(data)
        b[pos] = value
        with pytest.raises(MalformedError, match=words):
            client_plan.unpack_items(bytes(b))
