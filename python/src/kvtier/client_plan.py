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
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier import wire
from kvtier._codec import field
from kvtier.dcp import ChunkHash, Key, Namespace, join_hashes
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
    # The begin is also the engine's lookup (Go RestoreBeginRequest.Lookup):
    # counted as one, and a miss takes no restore slot nor history entry.
    lookup: bool = field("lookup", omit="omitempty", default=False)

    def to_binary(self) -> bytes:
        """The binary restore.begin request (``KVG1``, Go
        wire/beginreport.go): the chunk hashes as 16 bytes each where JSON
        spells 34 characters. MalformedError for what the form cannot carry
        (an instance over 64 bytes, a deadline outside 0..2^32-1 ms, a plan
        encoding other than JSON or binary)."""
        inst = self.instance.encode()
        b = self.begin
        if len(inst) > 64 or not 0 <= b.deadline_ms <= 0xFFFFFFFF or self.plan_encoding not in (
                "", "json", PLAN_ENCODING_BINARY):
            raise MalformedError(f"restore.begin: instance of {len(inst)} B (limit 64), deadline {b.deadline_ms} ms, "
                                 f"plan encoding {self.plan_encoding!r}")
        flags = ((1 if self.state_at_end else 0) | (2 if self.lookup else 0)
                 | (4 if self.plan_encoding == PLAN_ENCODING_BINARY else 0))
        return b"".join([_BEGIN_MAGIC, bytes([flags]), bytes(b.namespace), bytes([len(inst)]), inst,
                         b.deadline_ms.to_bytes(4, "big"), len(b.chunks).to_bytes(4, "big"), join_hashes(b.chunks)])


_BEGIN_MAGIC = b"KVG1"


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


def _holders(r: _Reader, what: str) -> list[wire.Rank]:
    return [r.rank(what) for _ in range(r.u16(what + "s"))]


def _holders_bytes(holders: Sequence[wire.Rank]) -> bytes:
    out = bytearray(len(holders).to_bytes(2, "big"))
    for h in holders:
        inst = h.instance.encode()
        if len(inst) > 0xFF or not 0 <= h.tp_rank <= 0xFFFF:
            raise ValueError(f"holder {h} does not fit (instance <= 255 B, TP rank in 0..65535)")
        out += bytes([len(inst)]) + inst + h.tp_rank.to_bytes(2, "big")
    return bytes(out)


_TIERS = frozenset(int(t) for t in wire.Tier)
_SWAP = sys.byteorder == "little"


def _be(typecode: str, values: Sequence[int]) -> bytes:
    """values as big-endian unsigned integers of typecode's width
    (OverflowError for one out of range)."""
    a = array(typecode, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _chunk_column(n: int, per: int) -> bytes:
    """0, ..., 0, 1, ..., n-1 (each per times) as big-endian u32s."""
    a = array("I", range(n))
    if per > 1:
        rep = array("I", bytes(4 * n * per))
        for e in range(per):
            rep[e::per] = a
        a = rep
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _from_be(typecode: str, data: bytes | bytearray) -> list[int]:
    a = array(typecode, bytes(data))
    if _SWAP:
        a.byteswap()
    return a.tolist()


@dataclass
class PlanItems:
    """One reader rank's items of a restore plan, kept in the plan's own
    form: its expectations (group, shard, last-only) once, the chunk hashes
    once, and 11 B per item (sum, holder index, tier). The items are, for
    chunk i of the prefix and each expectation in order (on chunks before
    the last, those not last-only), RetrieveItem(i, group, Key(namespace,
    chunk i's hash, shard, group), sum, Source(holders[holder], tier)).

    It exists so that a restore of many small chunks costs no Python
    object per item on the way from the coordinator's plan to the rankd's
    retrieve request (issue 25.4): the vLLM connector's scheduler decodes
    the plan into it (decode_plan_packed), hands it to its workers as
    bytes (to_bytes, "KVW1"), and each worker writes its retrieve request
    from it (retrieve_request). items() gives the RetrieveItems, equal to
    the plan's (decode_plan_binary)."""

    namespace: Namespace
    holders: list[wire.Rank]
    exps: list[tuple[int, int, bool]]  # group, shard, last-only
    hashes: bytes  # 16 B per chunk of the prefix, in order
    records: bytes  # _ITEM per item

    @property
    def prefix(self) -> int:
        return len(self.hashes) // 16

    def _inner(self) -> list[tuple[int, int, bool]]:
        return [e for e in self.exps if not e[2]]

    def __len__(self) -> int:
        return len(self.records) // _ITEM.size

    def _layout(self) -> list[tuple[int, int, int]]:
        """(chunk, group, shard) of every item, in order."""
        n = self.prefix
        inner = self._inner()
        return [(i, g, sh) for i in range(n) for g, sh, _ in (inner if i < n - 1 else self.exps)]

    def check(self, where: str) -> None:
        """MalformedError naming where unless the parts agree: whole chunk
        hashes, one record per item, an expectation for the inner chunks
        when there is any, every holder index and tier in range. The
        holder and tier bytes are read by slicing, not item by item."""
        if len(self.hashes) % 16:
            raise MalformedError(f"{where}: {len(self.hashes)} bytes of chunk hashes")
        inner = self._inner()
        if self.exps and not inner:
            raise MalformedError(f"{where}: every one of its {len(self.exps)} expectations is last-only")
        n = self.prefix
        want = (n - 1) * len(inner) + len(self.exps) if n else 0
        if len(self.records) != want * _ITEM.size:
            raise MalformedError(f"{where}: {n} chunks x {len(self.exps)} objects need {want * _ITEM.size} "
                                 f"bytes of items, got {len(self.records)}")
        if not self.records:
            return
        recs, size = self.records, _ITEM.size
        if len(self.holders) <= 0x100 and not any(recs[8::size]):
            bad = max(recs[9::size]) >= len(self.holders)
        else:
            bad = any(h >= len(self.holders) for _, h, _ in _ITEM.iter_unpack(recs))
        if bad:
            raise MalformedError(f"{where}: a holder index out of its {len(self.holders)} holders")
        tiers = set(recs[10::size])
        if not tiers <= _TIERS:
            raise MalformedError(f"{where}: tier {min(tiers - _TIERS)}")

    def items(self) -> list[wire.RetrieveItem]:
        """The items, each with its own RetrieveItem (no blocks)."""
        ns, hs = self.namespace, self.hashes
        chunks = [ChunkHash(hs[16 * i:16 * i + 16]) for i in range(self.prefix)]
        sources: dict[tuple[int, int], wire.Source] = {}
        out: list[wire.RetrieveItem] = []
        for (i, g, sh), (s, h, tier) in zip(self._layout(), _ITEM.iter_unpack(self.records), strict=True):
            src = sources.get((h, tier)) or _new_source(sources, self.holders, h, tier, f"plan items chunk {i}")
            out.append(wire.RetrieveItem(i, g, Key(ns, chunks[i], sh, g), s, src, []))
        return out

    @classmethod
    def of(cls, items: Sequence[wire.RetrieveItem]) -> PlanItems:
        """items (one reader's, of one plan, without blocks or skips: the
        plan's shape) in this form. ValueError for items of another shape."""
        if not items:
            return cls(Namespace(), [], [], b"", b"")
        ns, n = items[0].key.ns, items[-1].chunk + 1
        if not 0 < n <= len(items):  # every chunk of a plan has an item; never size by a foreign number
            raise ValueError(f"{len(items)} items end at chunk {n - 1}: not a plan's")
        last = [(it.group, it.key.shard) for it in items if it.chunk == n - 1]
        first = {(it.group, it.key.shard) for it in items if it.chunk == 0}
        exps = [(g, sh, n > 1 and (g, sh) not in first) for g, sh in last]
        holders: dict[wire.Rank, int] = {}
        hashes: dict[int, ChunkHash] = {}
        recs = bytearray()
        pl = cls(ns, [], exps, bytes(16 * n), b"")
        layout = pl._layout()
        if len(layout) != len(items):
            raise ValueError(f"{len(items)} items are not a plan's {len(layout)} of {n} chunks")
        for it, (i, g, sh) in zip(items, layout, strict=True):
            k = it.key
            if (it.chunk, it.group, k.shard) != (i, g, sh) or k.ns != ns or k.group != g or it.blocks or it.skip:
                raise ValueError(f"item of chunk {it.chunk} group {it.group} shard {k.shard}: not the plan's "
                                 f"(chunk {i} group {g} shard {sh}), another namespace, a key of another group, "
                                 "blocks or a skip")
            if hashes.setdefault(i, k.chunk) != k.chunk:
                raise ValueError(f"chunk {i}: two chunk hashes")
            recs += _ITEM.pack(it.sum, holders.setdefault(it.source.holder, len(holders)), int(it.source.tier))
        pl.holders, pl.records = list(holders), bytes(recs)
        pl.hashes = b"".join(bytes(hashes[i]) for i in range(n))
        return pl

    def to_bytes(self) -> bytes:
        """The packed form ("KVW1") for the engine's other processes,
        big-endian:

            magic "KVW1" | namespace (16 B)
            u16 H | H x holder: (u8 len(instance) | instance | u16 tp_rank)
            u16 E | E x (u16 group | u16 shard | u8 last_only)
            u32 C | C x chunk hash (16 B)
            the items: _ITEM each, to the end
        """
        out = bytearray(_LOAD_MAGIC)
        out += bytes(self.namespace)
        out += _holders_bytes(self.holders)
        out += len(self.exps).to_bytes(2, "big")
        for g, sh, last in self.exps:
            out += struct.pack(">HHB", g, sh, 1 if last else 0)
        out += self.prefix.to_bytes(4, "big")
        out += self.hashes
        out += self.records
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> PlanItems:
        """to_bytes' PlanItems back. MalformedError for bad input."""
        if data[:4] != _LOAD_MAGIC:
            raise MalformedError(f"packed items: missing magic {_LOAD_MAGIC!r}")
        r = _Reader(data)
        ns = Namespace(r.take(16, "namespace"))
        holders = _holders(r, "holder")
        exps = []
        for _ in range(r.u16("expectations")):
            g, sh, last = struct.unpack(">HHB", r.take(5, "expectation"))
            if last not in (0, 1):
                raise MalformedError(f"packed items: last-only flag {last}")
            exps.append((g, sh, bool(last)))
        n = int.from_bytes(r.take(4, "chunks"), "big")
        hashes = r.take(16 * n, "chunk hashes")
        pl = cls(ns, holders, exps, hashes, bytes(r.b[r.off:]))
        pl.check("packed items")
        return pl

    def retrieve_request(self, restore_id: str, session: str, block_ids: Sequence[Sequence[int]],
                         blocks_per_chunk: Sequence[int], first_chunk: int = 0,
                         skip: Sequence[int] = ()) -> bytes:
        """This reader's binary retrieve request (KVR1, KVR2 with a skip),
        the bytes wire.RetrieveRequest(restore_id, namespace, session,
        items).to_binary() encodes for items() with their blocks set:
        item (chunk i, group g) gets block_ids[g][(first_chunk + i) * bpc :
        (first_chunk + i + 1) * bpc], bpc = blocks_per_chunk[g]; on chunk 0
        the first skip[g] of them are the engine's own (Skip, not sent).
        ValueError when an item's blocks are fewer than its chunk's, or for
        values the form cannot carry.

        A plan without last-only expectations (every chunk has the same
        objects) is written column by column, with no Python work per item
        (but a slice of block ids per item where the objects of a chunk
        have unequal blocks per chunk): under half of the item-by-item
        encoding's time (examples/bench_load_items.py; issue 25.4). Any
        other shape, and any input the columns cannot take, goes item by
        item, which also names what is wrong."""
        out = self._request_by_columns(restore_id, session, block_ids, blocks_per_chunk, first_chunk, skip)
        if out is not None:
            return out
        return self._request_by_items(restore_id, session, block_ids, blocks_per_chunk, first_chunk, skip)

    def _request_by_columns(self, restore_id: str, session: str, block_ids: Sequence[Sequence[int]],
                            blocks_per_chunk: Sequence[int], first_chunk: int,
                            skip: Sequence[int]) -> bytes | None:
        """retrieve_request's bytes for a plan whose chunks all have the
        same expectations, or None (the caller then goes item by item):
        each field of the items is one big-endian column, laid into the
        items' bytes by strided slice assignment."""
        rid, sess = restore_id.encode(), session.encode()
        exps, n, recs = self.exps, self.prefix, self.records
        per = len(exps)
        if (len(rid) > 0xFFFF or len(sess) > 0xFF or n == 0 or per == 0 or any(last for _, _, last in exps)
                or len(recs) != n * per * _ITEM.size or len(self.hashes) != 16 * n):
            return None
        count = n * per
        try:
            bpcs = [int(blocks_per_chunk[g]) for g, _, _ in exps]
            sks = [int(skip[g]) if g < len(skip) else 0 for g, _, _ in exps]
            if any(b < 0 or not 0 <= k <= b for b, k in zip(bpcs, sks, strict=True)):
                return None
            ids: Sequence[int]
            if per == 1:
                lo = first_chunk * bpcs[0]
                ids = block_ids[exps[0][0]][lo + sks[0]:lo + n * bpcs[0]]
                if len(ids) != n * bpcs[0] - sks[0]:
                    return None
            elif len(set(bpcs)) == 1:
                # Interleave the groups' runs of b ids a chunk: column j of
                # each chunk's e-th run comes from every b-th id of e's row.
                b, lo = bpcs[0], first_chunk * bpcs[0]
                grid = array("Q", bytes(8 * count * b))
                for e, (g, _, _) in enumerate(exps):
                    run = array("Q", block_ids[g][lo:lo + n * b])
                    if len(run) != n * b:
                        return None
                    for j in range(b):
                        grid[e * b + j::per * b] = run[j::b]
                for e in reversed(range(per)):  # chunk 0's first skip[g] ids are the engine's own
                    del grid[e * b:e * b + sks[e]]
                ids = grid
            else:
                parts: list[int] = []
                rows = [block_ids[g] for g, _, _ in exps]
                for i in range(n):
                    for e in range(per):
                        b = bpcs[e]
                        lo = (first_chunk + i) * b
                        k = sks[e] if i == 0 else 0
                        part = rows[e][lo + k:lo + b]
                        if len(part) != b - k:
                            return None
                        parts.extend(part)
                ids = parts
            top = max(ids, default=0)
            if ids and (min(ids) < 0 or top > 0xFFFFFFFFFFFFFFFF):
                return None
            width = 4 if top <= 0xFFFFFFFF else 8
            holder_be = bytearray(2 * count)
            holder_be[0::2], holder_be[1::2] = recs[8::_ITEM.size], recs[9::_ITEM.size]
            if len(self.holders) > 1:
                hs = _from_be("H", holder_be)
                used = list(dict.fromkeys(hs))
                if used != list(range(len(used))):  # renumbered in order of first use
                    remap = {h: i for i, h in enumerate(used)}
                    holder_be = bytearray(_be("H", [remap[h] for h in hs]))
            else:
                used = [0]
                if holder_be.count(0) != len(holder_be):  # an index past the one holder: item by item says so
                    return None
            skips = any(sks)
            size = 31 if skips else 27
            body = bytearray(size * count)
            chunk_be = _chunk_column(n, per)
            cols = [(0, 4, chunk_be), (4, 2, _be("H", [g for g, _, _ in exps] * n)),
                    (6, 2, _be("H", [sh for _, sh, _ in exps] * n)), (8, 4, chunk_be), (20, 2, bytes(holder_be)),
                    (23, 4, _be("I", [b - k for b, k in zip(bpcs, sks, strict=True)] + bpcs * (n - 1)))]
            if skips:
                cols.append((27, 4, _be("I", sks + [0] * (count - per))))
            for off, w, col in cols:
                for j in range(w):
                    body[off + j::size] = col[j::w]
            for j in range(8):  # the sums, as the plan's records hold them
                body[12 + j::size] = recs[j::_ITEM.size]
            body[22::size] = recs[10::_ITEM.size]  # tier
            id_bytes = _be("I" if width == 4 else "Q", ids)
            holders = _holders_bytes([self.holders[h] for h in used])
        except (OverflowError, TypeError, ValueError, IndexError, KeyError):
            return None
        out = bytearray(b"KVR2" if skips else b"KVR1")
        out.append(width)
        out += len(rid).to_bytes(2, "big") + rid + bytes(self.namespace) + bytes([len(sess)]) + sess
        out += n.to_bytes(4, "big") + self.hashes
        out += holders
        out += count.to_bytes(4, "big") + body + id_bytes
        return bytes(out)

    def _request_by_items(self, restore_id: str, session: str, block_ids: Sequence[Sequence[int]],
                          blocks_per_chunk: Sequence[int], first_chunk: int,
                          skip: Sequence[int]) -> bytes:
        """retrieve_request's bytes, item by item: any plan's shape."""
        rid, sess = restore_id.encode(), session.encode()
        if len(rid) > 0xFFFF or len(sess) > 0xFF:
            raise ValueError(f"restore id {len(rid)} B (limit 65535), session {len(sess)} B (limit 255)")
        recs = self.records
        # The holders as the encoder lists them: in order of first use.
        used = dict.fromkeys(h for _, h, _ in _ITEM.iter_unpack(recs)) if len(self.holders) > 1 else {0: None}
        remap = {h: i for i, h in enumerate(used)} if recs else {}
        on_first = self.exps if self.prefix == 1 else self._inner()  # chunk 0's expectations
        skips = self.prefix > 0 and any(g < len(skip) and skip[g] for g, _, _ in on_first)
        item = struct.Struct(">IHHIQHBII" if skips else ">IHHIQHBI")
        body = bytearray(item.size * len(self))
        ids: list[int] = []
        extend, pack_into = ids.extend, item.pack_into
        off = 0
        for (i, g, sh), (s, h, tier) in zip(self._layout(), _ITEM.iter_unpack(recs), strict=True):
            bpc = blocks_per_chunk[g]
            lo = (first_chunk + i) * bpc
            sk = skip[g] if i == 0 and g < len(skip) else 0
            blocks = block_ids[g][lo + sk:lo + bpc]
            if len(blocks) != bpc - sk:
                raise ValueError(f"chunk {first_chunk + i} group {g}: {len(blocks)} block ids, want {bpc - sk}")
            if skips:
                pack_into(body, off, i, g, sh, i, s, remap[h], tier, len(blocks), sk)
            else:
                pack_into(body, off, i, g, sh, i, s, remap[h], tier, len(blocks))
            off += item.size
            extend(blocks)
        if ids and (min(ids) < 0 or max(ids) > 0xFFFFFFFFFFFFFFFF):
            raise ValueError(f"a block id outside 0..2^64-1 ({min(ids)}..{max(ids)})")
        width = 4 if not ids or max(ids) <= 0xFFFFFFFF else 8
        out = bytearray(b"KVR2" if skips else b"KVR1")
        out.append(width)
        out += len(rid).to_bytes(2, "big") + rid + bytes(self.namespace) + bytes([len(sess)]) + sess
        n_keys = self.prefix if recs else 0
        out += n_keys.to_bytes(4, "big") + self.hashes[:16 * n_keys]
        out += _holders_bytes([self.holders[h] for h in used] if recs else [])
        out += len(self).to_bytes(4, "big") + body
        out += struct.pack(f">{len(ids)}{'I' if width == 4 else 'Q'}", *ids)
        return bytes(out)


    def holding(self, block_id: int, block_ids: Sequence[Sequence[int]], blocks_per_chunk: Sequence[int],
                first_chunk: int = 0, skip: Sequence[int] = ()) -> list[tuple[int, int]]:
        """The (group, chunk) of every item whose blocks (as
        retrieve_request gives them) include block_id, sorted; one slice
        test per expectation when there is none."""
        n, out = self.prefix, set()
        for g, _, last in self.exps:
            bpc = blocks_per_chunk[g]
            c0 = n - 1 if last else 0
            sk = skip[g] if c0 == 0 and g < len(skip) else 0
            if block_id not in block_ids[g][(first_chunk + c0) * bpc + sk:(first_chunk + n) * bpc]:
                continue
            for c in range(c0, n):
                lo = (first_chunk + c) * bpc + (sk if c == 0 else 0)
                if block_id in block_ids[g][lo:(first_chunk + c + 1) * bpc]:
                    out.add((g, c))
        return sorted(out)


@dataclass
class PackedPlan:
    """A restore plan with each reader's items as PlanItems
    (decode_plan_packed)."""

    restore_id: str
    prefix: int
    ranks: dict[str, PlanItems]
    reason: str = ""


def decode_plan_packed(data: bytes, chunks: Sequence[ChunkHash]) -> PackedPlan:
    """Decodes a binary plan answering a restore.begin for chunks (the
    request's chunk list, which the plan refers to by index) without a
    Python object per item. Bad input raises MalformedError, as Go's
    DecodePlanBinary refuses it."""
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
    holders = _holders(r, "holder")
    hashes = join_hashes(chunks[:prefix])
    ranks: dict[str, PlanItems] = {}
    for _ in range(r.u16("readers")):
        name = str(r.rank("reader"))
        if name in ranks:
            raise MalformedError(f"restore plan: reader {name} twice")
        exps = []
        for j in range(r.u16("objects per chunk")):
            group, shard = r.u16("group"), r.u16("shard")
            last_only = r.u8("last-only flag") if flagged else 0
            if last_only not in (0, 1):
                raise MalformedError(f"restore plan: reader {name} expectation {j}: last-only flag {last_only}")
            exps.append((group, shard, bool(last_only)))
        inner = sum(1 for e in exps if not e[2])
        n = (prefix - 1) * inner + len(exps) if prefix else 0
        pl = PlanItems(ns, holders, exps, hashes, r.take(n * _ITEM.size, f"reader {name}'s items"))
        pl.check(f"restore plan: reader {name}")
        ranks[name] = pl
    if r.off != len(r.b):
        raise MalformedError(f"restore plan: {len(r.b) - r.off} bytes after the last reader")
    return PackedPlan(restore_id, prefix, ranks, reason)


def decode_plan_binary(data: bytes, chunks: Sequence[ChunkHash]) -> wire.RestorePlan:
    """Decodes a binary plan answering a restore.begin for chunks (the
    request's chunk list, which the plan refers to by index). Bad input
    raises MalformedError, as Go's DecodePlanBinary refuses it."""
    p = decode_plan_packed(data, chunks)
    return wire.RestorePlan(p.restore_id, p.prefix, {name: pl.items() for name, pl in p.ranks.items()}, p.reason)


_LOAD_MAGIC = b"KVW1"


def decode_plan(data: bytes, chunks: Sequence[ChunkHash], subject: str = "") -> wire.RestorePlan:
    """A restore.begin reply: the binary plan, or JSON (a plan, or an
    error reply, which raises its WireError)."""
    if is_binary_plan(data):
        return decode_plan_binary(data, chunks)
    return wire.decode_restore_plan(data, subject)


def decode_plan_packed_reply(data: bytes, chunks: Sequence[ChunkHash], subject: str = "") -> PackedPlan:
    """A restore.begin reply as a PackedPlan: the binary plan, or JSON (a
    plan, whose items are packed, or an error reply, which raises its
    WireError)."""
    if is_binary_plan(data):
        return decode_plan_packed(data, chunks)
    p = wire.decode_restore_plan(data, subject)
    try:
        ranks = {name: PlanItems.of(items) for name, items in p.ranks.items()}
    except ValueError as e:
        raise MalformedError(f"restore plan: {e}") from None
    return PackedPlan(p.restore_id, p.prefix, ranks, p.reason)


__all__ = ["PLAN_ENCODING_BINARY", "PackedPlan", "PlanItems", "RestoreBeginBinary", "decode_plan",
           "decode_plan_binary", "decode_plan_packed", "decode_plan_packed_reply", "is_binary_plan"]
