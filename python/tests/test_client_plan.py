"""The binary restore plan (kvtier.client_plan) against Go's bytes."""

from __future__ import annotations

import contextlib
import json
import pathlib
import random

import pytest

from kvtier import client_plan, dcp, wire
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
