"""restore.begin's plan in its binary form (Go wire/plan.go, magic "KVP1").

The JSON plan carries every key in hex (about 200 B per item), and
decoding it item by item through the generic codec costs about 40 us per
item on the 2-core development VM: 82 ms for one rank's 2,048 items (a
32k-token prompt in chunks of 16 tokens), several times what the restore's
copy takes on an H200. The binary plan is 11 B per item and decodes here in
a few microseconds per item (issue 25.4). The layout, big-endian:

    magic "KVP1"
    u8 len(restore_id) | restore_id
    u32 prefix
    u16 len(reason) | reason
    namespace (16 B)
    u16 H | H x holder: (u8 len(instance) | instance | u16 tp_rank)
    u16 R | R x reader, in Rank.String() order:
        u8 len(instance) | instance | u16 tp_rank
        u16 E | E x (u16 group | u16 shard)
        prefix x E x (u64 sum | u16 holder index | u8 tier), chunk-major

A reader's items are, for chunk i and expectation e in that order,
RetrieveItem(chunk=i, group=e.group, key=Key(namespace, chunks[i], e.shard,
e.group), sum, Source(holders[holder], tier)) with no blocks: exactly the
JSON plan's items. The chunk hashes are the request's, by index.

A restore.begin with state_at_end may answer "KVP2": each expectation
carries a u8 last_only flag after its shard (1: a recurrent group's
object, restored for the last chunk only); the chunks before the last have
items for the expectations with flag 0 only, the last chunk for all.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier import wire
from kvtier._codec import field
from kvtier.dcp import ChunkHash, Key, Namespace
from kvtier.errors import MalformedError

PLAN_ENCODING_BINARY = "binary"
_MAGIC = b"KVP1"
_MAGIC_LAST = b"KVP2"  # expectations flagged last-only (state_at_end)
_ITEM = struct.Struct(">QHB")  # sum, holder index, tier


@dataclass
class RestoreBeginBinary:
    """restore.begin's request asking for the binary plan (Go
    wire.RestoreBeginRequest with PlanEncoding set)."""

    begin: wire.RestoreBegin = field("", default_factory=wire.RestoreBegin)
    instance: str = field("instance", omit="omitempty", default="")
    plan_encoding: str = field("plan_encoding", omit="omitempty", default=PLAN_ENCODING_BINARY)
    state_at_end: bool = field("state_at_end", omit="omitempty", default=False)


def is_binary_plan(data: bytes) -> bool:
    """Whether a restore.begin reply is a binary plan (an error reply is
    JSON either way)."""
    return data[:4] in (_MAGIC, _MAGIC_LAST)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.b = memoryview(data)
        self.off = 4

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.b) - self.off:
            raise MalformedError(f"restore plan: truncated {what}: {len(self.b) - self.off} bytes left, want {n}")
        out = bytes(self.b[self.off:self.off + n])
        self.off += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        return int.from_bytes(self.take(2, what), "big")

    def text(self, n: int, what: str) -> str:
        try:
            return self.take(n, what).decode()
        except UnicodeDecodeError:
            raise MalformedError(f"restore plan: {what} is not UTF-8") from None

    def rank(self, what: str) -> wire.Rank:
        inst = self.text(self.u8(what), what)
        return wire.Rank(inst, self.u16(what))


def _new_source(sources: dict[tuple[int, int], wire.Source], holders: list[wire.Rank], h: int, tier: int,
                where: str) -> wire.Source:
    """The Source of holder index h and tier, kept in sources (the decoders
    share one object per pair: items never change their source);
    MalformedError naming where for an index or tier out of range."""
    if h >= len(holders):
        raise MalformedError(f"{where}: holder {h} of {len(holders)}")
    try:
        t = wire.Tier(tier)
    except ValueError:
        raise MalformedError(f"{where}: tier {tier}") from None
    src = sources[(h, tier)] = wire.Source(holders[h], t)
    return src


def decode_plan_binary(data: bytes, chunks: Sequence[ChunkHash]) -> wire.RestorePlan:
    """Decodes a binary plan answering a restore.begin for chunks (the
    request's chunk list, which the plan refers to by index). Bad input
    raises MalformedError, as Go's DecodePlanBinary refuses it."""
    if not is_binary_plan(data):
        raise MalformedError(f"restore plan: missing magic {_MAGIC!r}")
    flagged = data[:4] == _MAGIC_LAST
    r = _Reader(data)
    restore_id = r.text(r.u8("restore id"), "restore id")
    prefix = int.from_bytes(r.take(4, "prefix"), "big")
    reason = r.text(r.u16("reason"), "reason")
    ns = Namespace(r.take(16, "namespace"))
    if prefix > len(chunks):
        raise MalformedError(f"restore plan: prefix {prefix} exceeds the {len(chunks)} chunks requested")
    holders = [r.rank("holder") for _ in range(r.u16("holders"))]
    sources: dict[tuple[int, int], wire.Source] = {}  # (holder, tier): shared, as the items never change them
    ranks: dict[str, list[wire.RetrieveItem]] = {}
    for _ in range(r.u16("readers")):
        rk = r.rank("reader")
        name = str(rk)
        if name in ranks:
            raise MalformedError(f"restore plan: reader {name} twice")
        exps, inner = [], []  # inner: the expectations of the chunks before the last
        for j in range(r.u16("objects per chunk")):
            group, shard = r.u16("group"), r.u16("shard")
            last_only = r.u8("last-only flag") if flagged else 0
            if last_only not in (0, 1):
                raise MalformedError(f"restore plan: reader {name} expectation {j}: last-only flag {last_only}")
            exps.append((group, shard))
            if not last_only:
                inner.append((group, shard))
        if exps and not inner:
            raise MalformedError(f"restore plan: reader {name}: every one of its {len(exps)} expectations is last-only")
        n = (prefix - 1) * len(inner) + len(exps) if prefix else 0
        need = n * _ITEM.size
        if need > len(r.b) - r.off:
            raise MalformedError(f"restore plan: reader {name}: {prefix} chunks x {len(exps)} objects need "
                                 f"{need} bytes, {len(r.b) - r.off} left")
        items: list[wire.RetrieveItem] = []
        append = items.append
        unpack, off = _ITEM.unpack_from, r.off
        for i in range(prefix):
            ch = chunks[i]
            for group, shard in (inner if i < prefix - 1 else exps):
                s, h, tier = unpack(r.b, off)
                off += _ITEM.size
                src = sources.get((h, tier)) or _new_source(sources, holders, h, tier,
                                                            f"restore plan: reader {name} chunk {i}")
                append(wire.RetrieveItem(i, group, Key(ns, ch, shard, group), s, src, []))
        r.off = off
        ranks[name] = items
    if r.off != len(r.b):
        raise MalformedError(f"restore plan: {len(r.b) - r.off} bytes after the last reader")
    return wire.RestorePlan(restore_id, prefix, ranks, reason)


# One rank's items of a plan, packed for the engine's own processes (the
# vLLM connector's scheduler hands them to its workers in the step's
# metadata): the generic codec's JSON cost about 34 us an item to encode
# and decode on the development VM, 4.4 ms for a 32k-token prompt in
# 256-token chunks on one rank, on the scheduler's step. Big-endian:
#
#     magic "KVI1" | namespace (16 B)
#     u16 H | H x holder: (u8 len(instance) | instance | u16 tp_rank)
#     u32 C | C x chunk hash (16 B): the hash of chunk index c
#     u32 N | N x (u32 chunk | u16 group | u16 shard | u64 sum | u16 holder | u8 tier | u32 skip)
#
# Items carry no blocks (the worker sets them), every key is in the
# namespace, and its group is the item's.
_ITEMS_MAGIC = b"KVI1"
_PACKED = struct.Struct(">IHHQHBI")


def pack_items(items: Sequence[wire.RetrieveItem]) -> bytes:
    """items (one plan's, of one namespace, without blocks) packed; their
    order is kept. ValueError for items the form cannot carry."""
    ns = items[0].key.ns if items else Namespace()
    holders: dict[wire.Rank, int] = {}
    hashes: dict[int, ChunkHash] = {}
    body = bytearray()
    for it in items:
        k = it.key
        if k.ns != ns or k.group != it.group or it.blocks or not 0 <= it.chunk < 1 << 32:
            raise ValueError(f"item of chunk {it.chunk} group {it.group}: another namespace, a key of group "
                             f"{k.group}, blocks or a chunk index out of range")
        if hashes.setdefault(it.chunk, k.chunk) != k.chunk:
            raise ValueError(f"chunk {it.chunk}: two chunk hashes")
        h = holders.setdefault(it.source.holder, len(holders))
        body += _PACKED.pack(it.chunk, it.group, k.shard, it.sum, h, int(it.source.tier), it.skip)
    out = bytearray(_ITEMS_MAGIC)
    out += bytes(ns)
    out += len(holders).to_bytes(2, "big")
    for r in holders:
        inst = r.instance.encode()
        out += bytes([len(inst)]) + inst + r.tp_rank.to_bytes(2, "big")
    n_chunks = max(hashes) + 1 if hashes else 0
    out += n_chunks.to_bytes(4, "big")
    zero = bytes(16)
    for c in range(n_chunks):
        ch = hashes.get(c)
        out += bytes(ch) if ch is not None else zero
    out += len(items).to_bytes(4, "big")
    return bytes(out + body)


def unpack_items(data: bytes) -> list[wire.RetrieveItem]:
    """pack_items' items back. MalformedError for bad input."""
    if data[:4] != _ITEMS_MAGIC:
        raise MalformedError(f"packed items: missing magic {_ITEMS_MAGIC!r}")
    r = _Reader(data)
    ns = Namespace(r.take(16, "namespace"))
    holders = [r.rank("holder") for _ in range(r.u16("holders"))]
    n_chunks = int.from_bytes(r.take(4, "chunks"), "big")
    if n_chunks * 16 > len(r.b) - r.off:
        raise MalformedError(f"packed items: {n_chunks} chunk hashes, {len(r.b) - r.off} bytes left")
    hashes = [ChunkHash(r.take(16, "chunk hash")) for _ in range(n_chunks)]
    n = int.from_bytes(r.take(4, "items"), "big")
    if n * _PACKED.size != len(r.b) - r.off:
        raise MalformedError(f"packed items: {n} items need {n * _PACKED.size} bytes, {len(r.b) - r.off} left")
    sources: dict[tuple[int, int], wire.Source] = {}
    out: list[wire.RetrieveItem] = []
    append, unpack, off = out.append, _PACKED.unpack_from, r.off
    for _ in range(n):
        chunk, group, shard, s, h, tier, skip = unpack(r.b, off)
        off += _PACKED.size
        src = sources.get((h, tier)) or _new_source(sources, holders, h, tier, "packed items")
        if chunk >= n_chunks:
            raise MalformedError(f"packed items: chunk {chunk} of {n_chunks}")
        append(wire.RetrieveItem(chunk, group, Key(ns, hashes[chunk], shard, group), s, src, [], skip))
    return out


def decode_plan(data: bytes, chunks: Sequence[ChunkHash], subject: str = "") -> wire.RestorePlan:
    """A restore.begin reply: the binary plan, or JSON (a plan, or an
    error reply, which raises its WireError)."""
    if is_binary_plan(data):
        return decode_plan_binary(data, chunks)
    return wire.decode_restore_plan(data, subject)


__all__ = ["PLAN_ENCODING_BINARY", "RestoreBeginBinary", "decode_plan", "decode_plan_binary", "is_binary_plan",
           "pack_items", "unpack_items"]
