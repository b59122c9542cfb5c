"""Geometry and identity, as the Go package dcp defines them.

A :class:`Spec` (model, cache salt, layout, groups, chunk size) resolves to
page geometry and a namespace exactly as ``dcp.Spec.Resolve`` does: the same
rules (C2: semantic <= declared <= stride), the same canonical layout
encoding and SHA-256 fingerprint, the same namespace and prefix-chained
chunk hashes (C4). Pure: no I/O, no state.
"""

from __future__ import annotations

import array
import enum
import hashlib
import math
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from kvtier._codec import TextValue, field
from kvtier.errors import GeometryError, MalformedError

MAX_TP = 4096
MAX_PP = 256  # Go dcp.MaxPP
MAX_GROUPS = 64
MAX_NAME_BYTES = 256
KEY_SIZE = 37
_KEY_VERSION = 1

u16 = Annotated[int, "u16"]
u64 = Annotated[int, "u64"]


class Kind(enum.IntEnum):
    """Kind of a KV cache group (Go dcp.Kind; travels as its number)."""

    ATTENTION = 1
    SLIDING_WINDOW = 2
    RECURRENT = 3

    def __str__(self) -> str:
        return self.name.lower()


_HEX32 = re.compile(r"[0-9a-f]{32}")


class _Hash16(TextValue):
    """16 bytes that travel as 32 lowercase hex digits."""

    __slots__ = ("_b",)
    what = "hash"

    def __init__(self, b: bytes | bytearray = bytes(16)) -> None:
        if len(b) != 16:
            raise MalformedError(f"{self.what} is {len(b)} bytes, want 16")
        self._b = bytes(b)

    def __bytes__(self) -> bytes:
        return self._b

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._b == self._b

    def __lt__(self, other: _Hash16) -> bool:
        return self._b < other._b

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._b))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_text()!r})"

    def __str__(self) -> str:
        return self.to_text()

    def to_text(self) -> str:
        return self._b.hex()

    def is_zero(self) -> bool:
        return self._b == bytes(16)

    @classmethod
    def parse(cls, s: str) -> _Hash16:
        if len(s) != 32:
            raise MalformedError(f"{cls.what} {s[:80]!r}: want 32 hex digits, got {len(s)} characters")
        if not _HEX32.fullmatch(s):
            raise MalformedError(f"{cls.what} {s[:80]!r}: not 32 lowercase hex digits")
        return cls(bytes.fromhex(s))


class Namespace(_Hash16):
    """Model + cache salt + layout fingerprint (Go dcp.Namespace)."""

    what = "namespace"


class ChunkHash(_Hash16):
    """A chunk of tokens and every token before it (Go dcp.ChunkHash)."""

    what = "chunk hash"


def join_hashes(hashes: Sequence[_Hash16]) -> bytes:
    """The hashes' 16 bytes each, back to back, as the binary requests and
    plans carry them: a begin or lookup of 1,024 chunks joined them through
    bytes() per hash in ~115 us, twice a begin (the request, then the
    plan's decoding); reading the slot directly takes ~22 us."""
    hs = hashes if isinstance(hashes, (list, tuple)) else list(hashes)  # read twice below: no iterator
    try:
        return b"".join([h._b for h in hs])
    except AttributeError:  # not a _Hash16: whatever bytes() makes of it
        return b"".join(map(bytes, hs))


def _parse_u16(s: str, what: str) -> int:
    if not s or len(s) > 5 or (len(s) > 1 and s[0] == "0") or not s.isascii() or not s.isdigit():
        raise MalformedError(f"{what} {s[:80]!r}: want a decimal 0..65535 without leading zeros")
    v = int(s)
    if v > 65535:
        raise MalformedError(f"{what} {v} exceeds 65535")
    return v


@dataclass(frozen=True, order=True)
class Key(TextValue):
    """One stored object: a shard of one group of one chunk (Go dcp.Key).

    Text form ``<ns hex>.<chunk hex>.<shard>.<group>``; binary form 37 bytes
    (version 1, namespace, chunk, big-endian u16 shard and group)."""

    ns: Namespace = Namespace()
    chunk: ChunkHash = ChunkHash()
    shard: int = 0
    group: int = 0

    def __post_init__(self) -> None:
        for name in ("shard", "group"):
            v = getattr(self, name)
            if not 0 <= v <= 0xFFFF:
                raise MalformedError(f"key {name} {v} outside 0..65535")

    def to_text(self) -> str:
        return f"{self.ns}.{self.chunk}.{self.shard}.{self.group}"

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def parse(cls, s: str) -> Key:
        parts = s.split(".")
        if len(parts) != 4:
            raise MalformedError(
                f"key {s[:80]!r} has {len(parts)} dot-separated fields, want 4 (ns.chunk.shard.group)")
        return cls(Namespace.parse(parts[0]), ChunkHash.parse(parts[1]),  # type: ignore[arg-type]
                   _parse_u16(parts[2], "shard"), _parse_u16(parts[3], "object group"))

    def to_binary(self) -> bytes:
        return bytes([_KEY_VERSION]) + bytes(self.ns) + bytes(self.chunk) + struct.pack(">HH", self.shard, self.group)

    @classmethod
    def from_binary(cls, b: bytes) -> Key:
        if len(b) != KEY_SIZE:
            raise MalformedError(f"binary key is {len(b)} bytes, want {KEY_SIZE}")
        if b[0] != _KEY_VERSION:
            raise MalformedError(f"binary key version {b[0]}, want {_KEY_VERSION}")
        shard, group = struct.unpack(">HH", b[33:37])
        return cls(Namespace(b[1:17]), ChunkHash(b[17:33]), shard, group)


@dataclass
class Layout:
    """Parallel layout of one engine instance (Go dcp.Layout)."""

    tp: int = field("tp", default=1)
    dcp: int = field("dcp", default=1)
    interleave: int = field("interleave", default=1)
    pp: int = field("pp", default=1)
    # The pipeline stage this layout describes: a stage is a world of its
    # own, its own layers, namespace and ranks (Go Layout.PPStage).
    pp_stage: int = field("pp_stage", omit="omitempty", default=0)

    def validate(self) -> None:
        if self.tp < 1:
            raise GeometryError(f"TP size {self.tp} must be >= 1")
        if self.dcp < 1:
            raise GeometryError(f"DCP size {self.dcp} must be >= 1")
        if self.interleave < 1:
            raise GeometryError(f"DCP interleave {self.interleave} must be >= 1")
        if self.tp > MAX_TP:
            raise GeometryError(f"TP size {self.tp} exceeds the supported {MAX_TP}")
        if not 1 <= self.pp <= MAX_PP:
            raise GeometryError(f"PP size {self.pp}: want 1..{MAX_PP}")
        if not 0 <= self.pp_stage < self.pp:
            raise GeometryError(f"PP stage {self.pp_stage} of PP size {self.pp}: want 0..{self.pp - 1}")
        if self.tp % self.dcp != 0:
            raise GeometryError(f"TP size {self.tp} is not divisible by DCP size {self.dcp}")

    def dcp_rank(self, tp_rank: int) -> int:
        """The DCP rank of a TP rank (vLLM's DCP groups are runs of DCP
        consecutive TP ranks)."""
        return tp_rank % self.dcp

    def owner(self, pos: int, block_size: int) -> int:
        """The DCP rank holding token position pos of an attention group
        whose blocks hold block_size tokens per rank (Go Layout.Owner)."""
        vbo = pos % (block_size * self.dcp)
        return (vbo // self.interleave) % self.dcp

    def local_slot(self, pos: int, block_size: int, block_table: list[int]) -> tuple[int, int]:
        """(DCP rank owning pos, its slot in that rank's KV pool), where
        block_table maps virtual blocks of block_size*DCP tokens to block
        ids (Go Layout.LocalSlot)."""
        if pos < 0:
            raise GeometryError(f"token position {pos} is negative")
        w, i = self.dcp, self.interleave
        vbs = block_size * w
        vb = pos // vbs
        if vb >= len(block_table):
            raise GeometryError(f"token position {pos} needs virtual block {vb}, block table has {len(block_table)}")
        vbo = pos % vbs
        return (vbo // i) % w, block_table[vb] * block_size + (vbo // (w * i)) * i + vbo % i


@dataclass
class Group:
    """One KV cache group as the engine declares it (Go dcp.Group)."""

    name: str = field("name", omit="omitempty", default="")
    kind: Kind = field("kind", default=Kind.ATTENTION)
    mla: bool = field("mla", omit="omitempty", default=False)
    block_size: int = field("block_size", default=0)
    layers: int = field("layers", default=0)
    semantic_bytes: u64 = field("semantic_bytes", default=0)
    page_bytes: u64 = field("page_bytes", default=0)
    stride_bytes: u64 = field("stride_bytes", default=0)
    kv_format: str = field("kv_format", default="")


@dataclass(frozen=True)
class PageGeometry:
    """A Group resolved against a Layout (Go dcp.PageGeometry)."""

    group: Group
    span: int
    slots: int
    slot_bytes: int
    tiled: bool
    logical_tokens: int

    def pool_bytes(self, blocks: int) -> int:
        """The smallest pool holding blocks pages (no padding after the last)."""
        if blocks <= 0:
            return 0
        return (blocks - 1) * self.group.stride_bytes + self.group.page_bytes

    def pool_blocks(self, pool_bytes: int) -> int:
        if pool_bytes < self.group.page_bytes:
            return 0
        return (pool_bytes - self.group.page_bytes) // self.group.stride_bytes + 1


def resolve_group(g: Group, layout: Layout) -> PageGeometry:
    """Validates g against layout (C2) and derives its geometry."""
    layout.validate()
    name = g.name or (str(Kind(g.kind)) if g.kind in (1, 2, 3) else f"kind({int(g.kind)})")

    def fail(msg: str) -> GeometryError:
        return GeometryError(f"group {name!r}: {msg}")

    if g.kind not in (Kind.ATTENTION, Kind.SLIDING_WINDOW, Kind.RECURRENT):
        raise fail(f"unknown kind {int(g.kind)}")
    if g.mla and g.kind == Kind.RECURRENT:
        raise fail(f"MLA applies to attention groups, not {Kind(g.kind)}")
    if g.block_size < 1:
        raise fail(f"block size {g.block_size} tokens must be >= 1")
    if g.layers < 1:
        raise fail(f"layer count {g.layers} must be >= 1")
    if g.semantic_bytes < 1:
        raise fail(f"semantic page {g.semantic_bytes} B must be >= 1")
    if g.semantic_bytes > g.page_bytes:
        raise fail(f"semantic page {g.semantic_bytes} B exceeds declared page {g.page_bytes} B")
    if g.page_bytes > g.stride_bytes:
        raise fail(f"declared page {g.page_bytes} B exceeds block stride {g.stride_bytes} B")
    if len(g.kv_format.encode()) > 64:
        raise fail(f"KV format name is {len(g.kv_format.encode())} bytes, limit 64")
    if g.kind == Kind.RECURRENT:
        span, slots = g.block_size, layout.dcp
    else:
        if g.block_size % layout.interleave != 0:
            raise fail(f"DCP interleave {layout.interleave} does not divide block size {g.block_size}")
        span, slots = g.block_size * layout.dcp, g.block_size
        if span > (1 << 63) - 1:
            raise fail(f"span {g.block_size} x {layout.dcp} overflows")
    if slots > 1 and g.page_bytes % slots == 0:
        return PageGeometry(g, span, slots, g.page_bytes // slots, True, g.block_size)
    return PageGeometry(g, span, 1, g.page_bytes, False, g.block_size)


@dataclass
class Spec:
    """Everything that determines identity and geometry (Go dcp.Spec)."""

    model: str = field("model", default="")
    cache_salt: str = field("cache_salt", omit="omitempty", default="")
    layout: Layout = field("layout", default_factory=Layout)
    groups: list[Group] = field("groups", default_factory=list)
    chunk_tokens: int = field("chunk_tokens", default=0)

    def resolve(self) -> Resolved:
        return Resolved.of(self)


@dataclass(frozen=True)
class ShardPlan:
    shard: int
    writer: int
    readers: tuple[int, ...]


@dataclass(frozen=True)
class Resolved:
    """A validated Spec with everything derived from it (Go dcp.Resolved)."""

    spec: Spec
    geometry: tuple[PageGeometry, ...]
    scheduler_block: int
    fingerprint: bytes
    namespace: Namespace

    @classmethod
    def of(cls, s: Spec) -> Resolved:
        s.layout.validate()
        if not s.model:
            raise GeometryError("model name is empty")
        mb, sb = len(s.model.encode()), len(s.cache_salt.encode())
        if mb > MAX_NAME_BYTES or sb > MAX_NAME_BYTES:
            raise GeometryError(
                f"model name {mb} B or cache salt {sb} B over the {MAX_NAME_BYTES} B limit")
        if not 1 <= len(s.groups) <= MAX_GROUPS:
            raise GeometryError(f"{len(s.groups)} KV groups, want 1..{MAX_GROUPS}")
        if s.chunk_tokens < 1:
            raise GeometryError(f"chunk size {s.chunk_tokens} tokens must be >= 1")
        geo = tuple(resolve_group(g, s.layout) for g in s.groups)
        block = 1
        for pg in geo:
            block = math.lcm(block, pg.span)
            if block > (1 << 63) - 1:
                raise GeometryError(
                    f"scheduler block (LCM of group spans) overflows at group {pg.group.name!r} span {pg.span}")
        if s.chunk_tokens % block != 0:
            raise GeometryError(
                f"chunk size {s.chunk_tokens} tokens is not a multiple of the scheduler block {block}")
        fp = hashlib.sha256(_canonical(s)).digest()
        return cls(s, geo, block, fp, _namespace(s.model, s.cache_salt, fp))

    def blocks_per_chunk(self, gi: int) -> int:
        return self.spec.chunk_tokens // self.geometry[gi].span

    def shards(self, gi: int) -> list[ShardPlan]:
        tp, w = self.spec.layout.tp, self.spec.layout.dcp
        if not self.spec.groups[gi].mla:
            return [ShardPlan(t, t, (t,)) for t in range(tp)]
        return [ShardPlan(s, s, tuple(range(s, tp, w))) for s in range(w)]

    def store_shard(self, gi: int, tp_rank: int) -> int | None:
        """The shard TP rank tp_rank stores for group gi, or None."""
        if not self.spec.groups[gi].mla:
            return tp_rank
        return tp_rank if tp_rank < self.spec.layout.dcp else None

    def read_shard(self, gi: int, tp_rank: int) -> int:
        if not self.spec.groups[gi].mla:
            return tp_rank
        return tp_rank % self.spec.layout.dcp

    def chunk_hashes(self, tokens: list[int]) -> list[ChunkHash]:
        return chunk_hashes(self.namespace, tokens, self.spec.chunk_tokens)


def _canonical(s: Spec) -> bytes:
    out = bytearray(b"kvtier/layout/v1")

    def u64(v: int) -> None:
        out.extend(struct.pack(">Q", v & 0xFFFFFFFFFFFFFFFF))

    for v in (s.layout.tp, s.layout.dcp, s.layout.interleave, s.chunk_tokens, len(s.groups)):
        u64(v)
    for g in s.groups:
        for v in (int(g.kind), 1 if g.mla else 0, g.block_size, g.layers, g.semantic_bytes, g.page_bytes,
                  g.stride_bytes):
            u64(v)
        f = g.kv_format.encode()
        u64(len(f))
        out.extend(f)
    if s.layout.pp > 1:  # a pipeline stage is a world of its own (Go Layout.PPStage)
        u64(2)
        out.extend(b"pp")
        u64(s.layout.pp)
        u64(s.layout.pp_stage)
    return bytes(out)


def _namespace(model: str, salt: str, fp: bytes) -> Namespace:
    h = hashlib.sha256(b"kvtier/ns/v1")
    for s in (model, salt):
        b = s.encode()
        h.update(struct.pack(">Q", len(b)))
        h.update(b)
    h.update(fp)
    return Namespace(h.digest()[:16])


def chunk_hashes(ns: Namespace, tokens: list[int], chunk_tokens: int) -> list[ChunkHash]:
    """Prefix-chained hashes of every full chunk: h_k = SHA-256(h_{k-1} ||
    chunk k as little-endian uint32s)[:16], h_{-1} = the namespace. A
    trailing partial chunk gets no hash."""
    if chunk_tokens < 1:
        return []
    n = len(tokens) // chunk_tokens
    # Every full chunk's tokens packed at once (a 32k-token prompt is on
    # vLLM's scheduler step: 3.5 ms a chunk at a time, issue 25.4), then
    # hashed chunk by chunk.
    try:
        packed = array.array("I", tokens[:n * chunk_tokens]) if _U32_ARRAY else None
    except (OverflowError, TypeError):  # the slow path names the chunk
        packed = None
    if packed is None:
        body = _pack_tokens_slow(tokens, n, chunk_tokens)
    else:
        if sys.byteorder == "big":
            packed.byteswap()
        body = packed.tobytes()
    out: list[ChunkHash] = []
    prev = bytes(ns)
    step = 4 * chunk_tokens
    sha, new = hashlib.sha256, ChunkHash.__new__
    for k in range(n):
        prev = sha(prev + body[k * step:(k + 1) * step]).digest()[:16]
        h = new(ChunkHash)
        h._b = prev
        out.append(h)
    return out


# array("I") holds 4-byte items on this platform (the packed form's width).
_U32_ARRAY = array.array("I").itemsize == 4


def _pack_tokens_slow(tokens: list[int], n: int, chunk_tokens: int) -> bytes:
    """The first n chunks' tokens as little-endian uint32s, a chunk at a
    time: MalformedError names the chunk with a token id out of range."""
    out = bytearray()
    for k in range(n):
        try:
            out += struct.pack(f"<{chunk_tokens}I", *tokens[k * chunk_tokens:(k + 1) * chunk_tokens])
        except struct.error:
            raise MalformedError(f"chunk {k}: token ids must be 0..2^32-1") from None
    return bytes(out)
