"""Messages between engines, rankd and the coordinator (Go package wire).

Every dataclass encodes (``encode(msg)``) to the bytes Go's json.Marshal
produces for the same value; the golden vectors in wire/testdata/golden
hold both languages to that. :class:`Batch` has the binary event-batch
encoding (``KVB1``). :class:`Subjects` builds NATS subjects.
"""

from __future__ import annotations

import array
import enum
import re
import struct
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

from kvtier import _codec
from kvtier._codec import field
from kvtier.cuda import EventHandle, MemHandle
from kvtier.dcp import KEY_SIZE, MAX_TP, ChunkHash, Key, Namespace, Spec, join_hashes
from kvtier.errors import MalformedError, from_wire

u64 = Annotated[int, "u64"]
u32 = Annotated[int, "u32"]
u8 = Annotated[int, "u8"]

encode = _codec.encode
decode = _codec.decode

# Error codes that cross the wire (stable).
CODE_BAD_REQUEST = "bad_request"
CODE_UNKNOWN_NAMESPACE = "unknown_namespace"
CODE_GEOMETRY = "geometry"
CODE_NOT_FOUND = "not_found"
CODE_TOO_LARGE = "too_large"
CODE_UNAVAILABLE = "unavailable"
CODE_INTERNAL = "internal"
# Engine sessions (Go wire/session.go).
CODE_UNKNOWN_SESSION = "unknown_session"
CODE_STALE_SESSION = "stale_session"
CODE_UNAUTHORIZED = "unauthorized"

# Verdict states.
VERDICT_PENDING = "pending"
VERDICT_COMPLETE = "complete"
VERDICT_FAILED = "failed"
# refused: nothing was planned although chunks are stored (a reader rank is
# not alive, ...); reason says why. Never complete.
VERDICT_REFUSED = "refused"

# Coordinator operations (<p>.coord.<op>).
COORD_REGISTER = "ns.register"
COORD_LOOKUP = "lookup"
COORD_RESTORE_BEGIN = "restore.begin"
COORD_RESTORE_REPORT = "restore.report"
COORD_RESTORE_WAIT = "restore.wait"
COORD_RESTORE_CANCEL = "restore.cancel"

# Engine operations (<p>.rank.<instance>.<tp>.engine.<op>).
OP_REGISTER = "register"
OP_STORE = "store"
OP_RETRIEVE = "retrieve"

# HEADER_DEADLINE is the NATS header of a retrieve or store that carries the
# engine's deadline (Unix nanoseconds, decimal): past it the rankd places
# nothing more, because the engine has taken the blocks back, and a store
# waits for L1 room no longer (Go: wire.HeaderDeadline).
HEADER_DEADLINE = "Kvtier-Deadline"
# HEADER_GATHER_LIMIT is the NATS header of a store that says when the
# engine stops waiting for its answer and may reuse the blocks (Unix
# nanoseconds): a gather that ends later is not committed, its bytes may be
# torn (Go: wire.HeaderGatherLimit).
HEADER_GATHER_LIMIT = "Kvtier-Gather-Limit"
# A retrieve request's reply lists the failed items only (Go
# wire.HeaderResults, ResultsFailed); a rankd that predates it lists all.
HEADER_RESULTS = "Kvtier-Results"
# The NATS header of a retrieve that bounds the rate of its copies, bytes
# per second (Go: wire.HeaderPace; at least MIN_PACE): an engine loading a
# prompt while it decodes others trades the load's time for their steps.
HEADER_PACE = "Kvtier-Pace"
MIN_PACE = 100 << 20  # Go: transfer.MinPace
# What a coordinator from before the binary begin and report answers them
# with (Go wire.NotJSONRefusal): the only refusal a sender falls back to
# JSON on.
NOT_JSON_REFUSAL = "invalid character 'K' looking for beginning of value"
RESULTS_FAILED = "failed"
OP_RELEASE = "release"
OP_STATUS = "status"
OP_CUT = "cut"  # cuts a request's stores waiting before their gather (rankd.CutRequest)

DEFAULT_PREFIX = "kvtier"
MAX_BATCH_EVENTS = 1 << 16


class Tier(enum.IntEnum):
    L1 = 1  # pinned host memory; lost when rankd restarts
    L2 = 2  # files; survive restarts
    L3 = 3  # an S3-compatible object store shared by the instance

    def __str__(self) -> str:
        return self.name


class EventKind(enum.IntEnum):
    STORED = 1
    REMOVED = 2


_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def valid_instance(name: str) -> None:
    """Raises MalformedError unless name is 1..64 of [A-Za-z0-9_-]."""
    if not _INSTANCE.fullmatch(name):
        raise MalformedError(f"instance name {name!r}: want 1..64 characters of [A-Za-z0-9_-]")


@dataclass(frozen=True)
class Rank:
    """One rankd: its engine instance and TP rank."""

    instance: str = field("instance", default="")
    tp_rank: int = field("tp_rank", default=0)

    def __str__(self) -> str:
        return f"{self.instance}/{self.tp_rank}"

    @classmethod
    def parse(cls, s: str) -> Rank:
        i = s.rfind("/")
        if i <= 0:
            raise MalformedError(f"rank {s!r}: want instance/tp_rank")
        tail = s[i + 1:]
        if not tail.isascii() or not tail.isdigit() or int(tail) > MAX_TP:
            raise MalformedError(f"rank {s!r}: TP rank not in 0..{MAX_TP}")
        return cls(s[:i], int(tail))


@dataclass(frozen=True)
class Subjects:
    """NATS subjects under one prefix (Go wire.Subjects)."""

    prefix: str = DEFAULT_PREFIX

    def _p(self) -> str:
        return self.prefix or DEFAULT_PREFIX

    def engine(self, r: Rank, op: str) -> str:
        return f"{self._p()}.rank.{r.instance}.{r.tp_rank}.engine.{op}"

    def coord(self, op: str) -> str:
        """The unscoped coordinator subject: served only by an --insecure
        coordinator. Engines use engine_coord."""
        return f"{self._p()}.coord.{op}"

    def engine_coord(self, instance: str, op: str) -> str:
        """Where engine instance sends coordinator op (ns.register, lookup,
        restore.begin, restore.wait); only engine-<instance> may publish."""
        return f"{self._p()}.coord.{op}.{instance}"

    def report(self, r: Rank) -> str:
        """Where rank r (only) sends its restore reports."""
        return f"{self._p()}.coord.{COORD_RESTORE_REPORT}.{r.instance}.{r.tp_rank}"

    def admin(self, op: str) -> str:
        return f"{self._p()}.admin.{op}"

    def events(self, r: Rank) -> str:
        return f"{self._p()}.events.{r.instance}.{r.tp_rank}"

    def heartbeat(self, r: Rank) -> str:
        return f"{self._p()}.heartbeat.{r.instance}.{r.tp_rank}"

    def inventory(self, r: Rank) -> str:
        return f"{self._p()}.rank.{r.instance}.{r.tp_rank}.inventory"

    def freed(self, r: Rank) -> str:
        """Where rank r publishes BlocksFreed to its engine worker."""
        return f"{self._p()}.rank.{r.instance}.{r.tp_rank}.freed"


@dataclass
class Error:
    code: str = field("code", default="")
    message: str = field("message", default="")
    # With code unavailable: how long the sender suggests waiting before
    # the same request is sent again (a coordinator still opening its
    # index sets it); 0: no hint.
    retry_after_ms: int = field("retry_after_ms", omit="omitempty", default=0)


T = TypeVar("T")


@dataclass
class Reply(Generic[T]):
    """The envelope of every JSON reply: exactly one of error or ok."""

    error: Error | None = field("error", omit="omitempty", default=None)
    ok: T | None = field("ok", omit="omitempty", default=None)


def encode_reply(ok: Any = None, error: Error | None = None) -> bytes:
    return encode(Reply(error=error, ok=ok))


def decode_reply(cls: type[T], data: bytes, subject: str = "") -> T:
    """Decodes a reply envelope: returns the payload, raises the error
    reply as a kvtier.errors.WireError subclass, MalformedError otherwise."""
    obj = _codec.loads(data)
    if not isinstance(obj, dict):
        raise MalformedError(f"reply from {subject or '?'} is not a JSON object")
    err = obj.get("error")
    if err is not None:
        e = _codec.from_obj(Error, err, "reply.error")
        raise from_wire(e.code, e.message, subject, e.retry_after_ms)
    if obj.get("ok") is None:
        raise MalformedError(f"reply from {subject or '?'} has neither ok nor error")
    return _codec.from_obj(cls, obj["ok"], f"{cls.__name__}")  # type: ignore[no-any-return]


# ---------------------------------------------------------------- engine API


@dataclass
class PoolRegistration:
    group: int = field("group", default=0)
    layer: int = field("layer", default=0)
    handle: MemHandle = field("handle", default_factory=MemHandle)


@dataclass
class RegisterRequest:
    spec: Spec = field("spec", default_factory=Spec)
    device_uuid: str = field("device_uuid", default="")
    pools: list[PoolRegistration] = field("pools", default_factory=list)


@dataclass
class RegisterReply:
    namespace: Namespace = field("namespace", default_factory=Namespace)
    # The rankd's session of this registration (32 hex characters); every
    # later store, retrieve and release sends it. Empty from the
    # coordinator's ns.register.
    session: str = field("session", omit="omitempty", default="")
    # The session this registration superseded, if any.
    superseded: str = field("superseded", omit="omitempty", default="")


@dataclass
class ChunkBlocks:
    chunk: ChunkHash = field("chunk", default_factory=ChunkHash)
    blocks: list[list[int]] = field("blocks", default_factory=list)  # [group][block]
    # The chunk's index in the prompt (0-based; 0 also when not known). A
    # prompt's chunks are stored in concurrent requests, so they arrive out
    # of order: a rank whose L2 bound is smaller than the prompt keeps its
    # lowest positions there (the prefix a restore needs).
    pos: u32 = field("pos", omit="omitempty", default=0)


@dataclass
class StoreRequest:
    request_id: str = field("request_id", default="")
    namespace: Namespace = field("namespace", default_factory=Namespace)
    session: str = field("session", default="")
    chunks: list[ChunkBlocks] = field("chunks", default_factory=list)
    event: EventHandle = field("event", default_factory=EventHandle)

    def to_binary(self) -> bytes:
        """The binary store request (Go wire/reqbin.go): the bytes Go's
        StoreRequest.MarshalBinary encodes for the same value, ``KVS1`` when
        every chunk's position is 0 (what a rankd from before positions
        reads), else ``KVS2`` (a u32 position after each chunk hash).
        Raises MalformedError for a request the form cannot carry."""
        rid, sess = _utf8(self.request_id), _utf8(self.session)
        backend, device, raw = _utf8(self.event.backend), _utf8(self.event.device), bytes(self.event.raw)
        if len(rid) > 0xFFFF or len(raw) > 0xFFFF:
            raise MalformedError(f"store request: request id {len(rid)} B, event handle {len(raw)} B: limit 65535 each")
        if max(len(sess), len(backend), len(device)) > 0xFF:
            raise MalformedError(f"store request: session {len(sess)} B, event backend {len(backend)} B, "
                                 f"event device {len(device)} B: limit 255 each")
        if len(self.chunks) > _U32:
            raise MalformedError(f"store request: {len(self.chunks)} chunks, limit {_U32}")
        table = bytearray()
        ids: list[int] = []
        with_pos = any(c.pos != 0 for c in self.chunks)
        for i, c in enumerate(self.chunks):
            if len(c.blocks) > 0xFF:
                raise MalformedError(f"store request: chunk {i} has {len(c.blocks)} groups, limit 255")
            if not 0 <= c.pos <= _U32:
                raise MalformedError(f"store request: chunk {i} position {c.pos} outside 0..{_U32}")
            table += bytes(c.chunk)
            if with_pos:
                table += struct.pack(">I", c.pos)
            table.append(len(c.blocks))
            for g in c.blocks:
                table += struct.pack(">I", len(g))
                ids.extend(g)
        width, packed = _pack_blocks(ids, "store request")
        out = bytearray(_STORE_MAGIC_POS if with_pos else _STORE_MAGIC)
        out.append(width)
        out += struct.pack(">H", len(rid)) + rid + bytes(self.namespace)
        out += bytes([len(sess)]) + sess + bytes([len(backend)]) + backend + bytes([len(device)]) + device
        out += struct.pack(">H", len(raw)) + raw + struct.pack(">I", len(self.chunks))
        return bytes(out + table + packed)


@dataclass
class StoreReply:
    stored: int = field("stored", default=0)
    deduped: int = field("deduped", default=0)
    failed: list[str] = field("failed", omit="omitempty", default_factory=list)
    # The store ended with the device possibly still reading the blocks: do
    # not reuse them or destroy the producer event until the rankd publishes
    # BlocksFreed for this store (C10).
    blocks_in_use: bool = field("blocks_in_use", omit="omitempty", default=False)
    # not_durable says why the objects are in L1 only although the policy
    # promises L2; the store itself succeeded.
    not_durable: str = field("not_durable", omit="omitempty", default="")


@dataclass
class Source:
    holder: Rank = field("holder", default_factory=Rank)
    tier: u8 = field("tier", default=0)


@dataclass
class BlocksFreed:
    """Published by a rankd when the device has stopped reading the blocks
    of a store it answered with blocks_in_use (C10): only then may the
    engine reuse them or destroy the store's event. A store is named by its
    request id and its chunks, in request order."""

    rank: Rank = field("rank", default_factory=Rank)
    request_id: str = field("request_id", default="")
    namespace: Namespace = field("namespace", default_factory=Namespace)
    chunks: list[ChunkHash] = field("chunks", default_factory=list)


@dataclass
class RetrieveItem:
    chunk: int = field("chunk", default=0)
    group: int = field("group", default=0)
    key: Key = field("key", default_factory=Key)
    sum: u64 = field("sum", default=0)
    source: Source = field("source", default_factory=Source)
    blocks: list[int] = field("blocks", default_factory=list)
    # The chunk's first blocks the engine holds already (Go
    # wire.RetrieveItem.Skip): their pages are not placed, blocks are the
    # targets of the chunk's blocks skip.. only; the whole object is still
    # verified. A rankd from before it refuses the item.
    skip: int = field("skip", omit="omitempty", default=0)


@dataclass
class RetrieveRequest:
    restore_id: str = field("restore_id", omit="omitempty", default="")
    namespace: Namespace = field("namespace", default_factory=Namespace)
    session: str = field("session", default="")
    items: list[RetrieveItem] = field("items", default_factory=list)

    def to_binary(self) -> bytes:
        """The binary retrieve request (``KVR1``, Go wire/reqbin.go): the
        namespace once, a table of the items' chunk hashes and one of their
        holders, fixed-width items, the block ids packed; the bytes Go's
        RetrieveRequest.MarshalBinary encodes for the same value. ``KVR2``
        when an item skips blocks: a u32 skip after each item. Raises
        MalformedError for a request the form cannot carry (an item's key in
        another namespace or of another group, values out of range)."""
        rid, sess = _utf8(self.restore_id), _utf8(self.session)
        if len(rid) > 0xFFFF or len(sess) > 0xFF:
            raise MalformedError(f"retrieve request: restore id {len(rid)} B (limit 65535), "
                                 f"session {len(sess)} B (limit 255)")
        if len(self.items) > _U32:
            raise MalformedError(f"retrieve request: {len(self.items)} items, limit {_U32}")
        keys: dict[ChunkHash, int] = {}
        holders: dict[tuple[str, int], int] = {}
        holder_table = bytearray()
        items = bytearray()
        ids: list[int] = []
        skips = any(it.skip for it in self.items)
        for i, it in enumerate(self.items):
            if it.key.ns != self.namespace:
                raise MalformedError(f"retrieve request: item {i} key {it.key} is not in namespace {self.namespace}")
            if not 0 <= it.group <= 0xFFFF or it.group != it.key.group:
                raise MalformedError(f"retrieve request: item {i} group {it.group}, its key's group {it.key.group}: "
                                     "want the same, in 0..65535")
            if not 0 <= it.chunk <= _U32 or len(it.blocks) > _U32:
                raise MalformedError(f"retrieve request: item {i} chunk index {it.chunk}, {len(it.blocks)} block ids: "
                                     f"want 0..{_U32} each")
            if not 0 <= int(it.source.tier) <= 0xFF:
                raise MalformedError(f"retrieve request: item {i} tier {it.source.tier}")
            if not 0 <= it.skip <= _U32:
                raise MalformedError(f"retrieve request: item {i} skips {it.skip} blocks, outside 0..{_U32}")
            k = keys.setdefault(it.key.chunk, len(keys))
            h = it.source.holder
            hk = (h.instance, h.tp_rank)
            hi = holders.get(hk)
            if hi is None:
                inst = _utf8(h.instance)
                if len(inst) > 0xFF or not 0 <= h.tp_rank <= 0xFFFF:
                    raise MalformedError(f"retrieve request: item {i} holder {h} does not fit "
                                         "(instance <= 255 B, TP rank in 0..65535)")
                if len(holders) == 0xFFFF:
                    raise MalformedError("retrieve request: more than 65535 holders")
                hi = holders[hk] = len(holders)
                holder_table += bytes([len(inst)]) + inst + struct.pack(">H", h.tp_rank)
            items += struct.pack(">IHHIQHBI", it.chunk, it.group, it.key.shard, k, it.sum, hi,
                                 int(it.source.tier), len(it.blocks))
            if skips:
                items += struct.pack(">I", it.skip)
            ids.extend(it.blocks)
        width, packed = _pack_blocks(ids, "retrieve request")
        out = bytearray(_RETRIEVE_MAGIC_SKIP if skips else _RETRIEVE_MAGIC)
        out.append(width)
        out += struct.pack(">H", len(rid)) + rid + bytes(self.namespace) + bytes([len(sess)]) + sess
        out += struct.pack(">I", len(keys))
        for c in keys:  # insertion order: first appearance, as Go's table
            out += bytes(c)
        out += struct.pack(">H", len(holders)) + holder_table
        out += struct.pack(">I", len(self.items)) + items
        return bytes(out + packed)

    @classmethod
    def from_binary(cls, data: bytes) -> RetrieveRequest:
        """A binary retrieve request (KVR1 or KVR2) decoded, as Go's
        DecodeRetrieveBinary decodes it (without its limits): the items
        with their blocks. MalformedError for bad input."""
        b = memoryview(data)
        if bytes(b[:4]) not in (_RETRIEVE_MAGIC, _RETRIEVE_MAGIC_SKIP) or len(b) < 5:
            raise MalformedError(f"retrieve request: missing magic {_RETRIEVE_MAGIC!r}")
        skips = bytes(b[:4]) == _RETRIEVE_MAGIC_SKIP
        width = b[4]
        if width not in (4, 8):
            raise MalformedError(f"retrieve request: block id width {width}, want 4 or 8")
        off = 5

        def take(n: int, what: str) -> bytes:
            nonlocal off
            if n > len(b) - off:
                raise MalformedError(f"retrieve request: truncated {what}: {len(b) - off} bytes left, want {n}")
            off += n
            return bytes(b[off - n:off])

        def num(n: int, what: str) -> int:
            return int.from_bytes(take(n, what), "big")

        try:
            rid = take(num(2, "restore id"), "restore id").decode()
            ns = Namespace(take(16, "namespace"))
            sess = take(num(1, "session"), "session").decode()
            keys = [ChunkHash(take(16, "key")) for _ in range(num(4, "keys"))]
            holders = [Rank(take(num(1, "holder"), "holder").decode(), num(2, "holder"))
                       for _ in range(num(2, "holders"))]
        except UnicodeDecodeError:
            raise MalformedError("retrieve request: a string is not UTF-8") from None
        size = 31 if skips else 27
        n = num(4, "items")
        if n * size > len(b) - off:
            raise MalformedError(f"retrieve request: {n} items need {n * size} bytes, {len(b) - off} left")
        items, counts = [], []
        for i in range(n):
            chunk, group, shard, k, s, h, tier, count = struct.unpack_from(">IHHIQHBI", b, off)
            skip = struct.unpack_from(">I", b, off + 27)[0] if skips else 0
            off += size
            if k >= len(keys) or h >= len(holders):
                raise MalformedError(f"retrieve request: item {i}: key {k} of {len(keys)}, holder {h} of "
                                     f"{len(holders)}")
            try:
                t = Tier(tier)
            except ValueError:
                raise MalformedError(f"retrieve request: item {i}: tier {tier}") from None
            items.append(RetrieveItem(chunk, group, Key(ns, keys[k], shard, group), s, Source(holders[h], t), [],
                                      skip))
            counts.append(count)
        if sum(counts) * width != len(b) - off:
            raise MalformedError(f"retrieve request: {sum(counts)} block ids of {width} B, {len(b) - off} bytes left")
        code = "I" if width == 4 else "Q"
        ids = list(struct.unpack(f">{sum(counts)}{code}", b[off:]))
        at = 0
        for it, c in zip(items, counts, strict=True):
            it.blocks = ids[at:at + c]
            at += c
        return cls(rid, ns, sess, items)


_STORE_MAGIC = b"KVS1"
_STORE_MAGIC_POS = b"KVS2"  # KVS1 with a position per chunk
_RETRIEVE_MAGIC = b"KVR1"
_RETRIEVE_MAGIC_SKIP = b"KVR2"  # KVR1 with a skip per item
_U32 = 0xFFFFFFFF


def _utf8(s: str) -> bytes:
    return s.encode("utf-8")


def _pack_blocks(ids: list[int], what: str) -> tuple[int, bytes]:
    """The block ids packed big-endian, 4 bytes each when all fit in 32
    bits, else 8 (Go wire/reqbin.go), and that width."""
    if not ids:
        return 4, b""
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise MalformedError(f"{what}: block id {lo} is negative")
    if hi > 0xFFFFFFFFFFFFFFFF:
        raise MalformedError(f"{what}: block id {hi} exceeds 64 bits")
    width, code = (4, "I") if hi <= _U32 else (8, "Q")
    a = array.array(code, ids) if array.array(code).itemsize == width else None
    if a is None:  # a platform whose C type is not that wide
        return width, struct.pack(f">{len(ids)}{code}", *ids)
    if sys.byteorder == "little":
        a.byteswap()
    return width, a.tobytes()


@dataclass
class ItemResult:
    chunk: int = field("chunk", default=0)
    group: int = field("group", default=0)
    ok: bool = field("ok", default=False)
    sum: u64 = field("sum", default=0)
    reason: str = field("reason", omit="omitempty", default="")


@dataclass
class RetrieveReply:
    results: list[ItemResult] = field("results", default_factory=list)


@dataclass
class ReleaseRequest:
    """rankd's release request (Go rankd.ReleaseRequest)."""

    namespace: Namespace = field("namespace", default_factory=Namespace)
    session: str = field("session", default="")


@dataclass
class ReleaseReply:
    namespace: Namespace = field("namespace", default_factory=Namespace)
    session: str = field("session", default="")


@dataclass
class DeviceStatus:
    backend: str = field("backend", default="")
    uuid: str = field("uuid", default="")
    name: str = field("name", default="")


@dataclass
class StatusReply:
    """The part of rankd's status reply an engine reads."""

    rank: Rank = field("rank", default_factory=Rank)
    tp_size: int = field("tp_size", default=0)
    incarnation: u64 = field("incarnation", default=0)
    device: DeviceStatus = field("device", default_factory=DeviceStatus)
    accepting: bool = field("accepting", default=False)


# ---------------------------------------------------------------- coordinator


@dataclass
class LookupRequest:
    namespace: Namespace = field("namespace", default_factory=Namespace)
    chunks: list[ChunkHash] = field("chunks", default_factory=list)
    instance: str = field("instance", omit="omitempty", default="")
    detail: bool = field("detail", omit="omitempty", default=False)
    # A recurrent group's object needed for the prefix's last chunk only
    # (Go LookupRequest.StateAtEnd; a coordinator that predates it refuses
    # the request).
    state_at_end: bool = field("state_at_end", omit="omitempty", default=False)

    def to_binary(self) -> bytes:
        """The binary lookup request (``KVL1``, Go wire/lookup.go): the
        chunk hashes as 16 bytes each where JSON spells 34 characters (the
        coordinator accepts both). MalformedError for an instance over 64
        bytes."""
        inst = _utf8(self.instance)
        if len(inst) > 64:
            raise MalformedError(f"lookup: instance name {len(inst)} bytes, limit 64")
        flags = (1 if self.detail else 0) | (2 if self.state_at_end else 0)
        return b"".join([_LOOKUP_MAGIC, bytes([flags]), bytes(self.namespace), bytes([len(inst)]), inst,
                         len(self.chunks).to_bytes(4, "big"), join_hashes(self.chunks)])


_LOOKUP_MAGIC = b"KVL1"


@dataclass
class ObjectPlacement:
    holder: Rank = field("holder", default_factory=Rank)
    tier: u8 = field("tier", default=0)
    size: u64 = field("size", default=0)
    sum: u64 = field("sum", default=0)
    incarnation: u64 = field("incarnation", omit="omitempty", default=0)
    seq: u64 = field("seq", omit="omitempty", default=0)


@dataclass
class ObjectInfo:
    chunk: int = field("chunk", default=0)
    key: Key = field("key", default_factory=Key)
    reader: str = field("reader", omit="omitempty", default="")
    placements: list[ObjectPlacement] = field("placements", default_factory=list)


@dataclass
class LookupReply:
    instance: str = field("instance", omit="omitempty", default="")
    prefix: int = field("prefix", default=0)
    sources: list[ObjectInfo] = field("sources", omit="omitempty", default_factory=list)
    not_alive: list[str] = field("not_alive", omit="omitempty", default_factory=list)
    reason: str = field("reason", omit="omitempty", default="")


@dataclass
class RestoreBegin:
    namespace: Namespace = field("namespace", default_factory=Namespace)
    chunks: list[ChunkHash] = field("chunks", default_factory=list)
    deadline_ms: int = field("deadline_ms", omit="omitempty", default=0)


@dataclass
class RestoreBeginRequest:
    """restore.begin's request: a RestoreBegin (embedded: its fields inline)
    and optionally the engine instance whose ranks restore."""

    begin: RestoreBegin = field("", default_factory=RestoreBegin)
    instance: str = field("instance", omit="omitempty", default="")


@dataclass
class RestorePlan:
    restore_id: str = field("restore_id", default="")
    prefix: int = field("prefix", default=0)
    ranks: dict[str, list[RetrieveItem]] = field("ranks", default_factory=dict)  # by str(Rank)
    reason: str = field("reason", omit="omitempty", default="")


def decode_restore_plan(data: bytes, subject: str = "") -> RestorePlan:
    """Decodes restore.begin's reply. The one place that knows the plan's
    encoding, so a compact encoding replaces only this function."""
    plan = decode_reply(RestorePlan, data, subject)
    for name in plan.ranks:
        Rank.parse(name)
    return plan


@dataclass
class RestoreReport:
    restore_id: str = field("restore_id", default="")
    rank: Rank = field("rank", default_factory=Rank)
    results: list[ItemResult] = field("results", default_factory=list)


@dataclass
class RestoreWait:
    restore_id: str = field("restore_id", default="")


@dataclass
class CutRequest:
    """Cuts the caller's stores of a request that wait before their gather
    (Go's rankd.CutRequest). through (Unix nanoseconds, 0 for none): only
    the stores whose deadline is at or before it, also one that reaches
    the rankd after the cut."""

    request_id: str = field("request_id", default="")
    through: int = field("through", omit="omitempty", default=0)


@dataclass
class CutReply:
    stores: int = field("stores", default=0)


@dataclass
class RestoreCancel:
    """Withdraws a begun restore whose retrieves were never sent (Go's
    wire.RestoreCancel)."""

    restore_id: str = field("restore_id", default="")


@dataclass
class CancelReply:
    cancelled: bool = field("cancelled", default=False)
    state: str = field("state", default="")


@dataclass
class RestoreVerdict:
    restore_id: str = field("restore_id", default="")
    state: str = field("state", default="")
    prefix: int = field("prefix", default=0)
    failed: list[int] = field("failed", omit="omitempty", default_factory=list)  # chunk indexes, sorted
    reasons: list[str] = field("reasons", omit="omitempty", default_factory=list)  # reasons[i]: failed[i]'s first
    # group_reasons, when set, is parallel to failed: every failed group's
    # reason of chunk failed[i], by group (issue 27); a coordinator leaves
    # it out when no chunk failed in more than one group. Read it through
    # chunk_reasons.
    group_reasons: list[list[str]] = field("group_reasons", omit="omitempty", default_factory=list)
    # reason says why a refused restore was refused; empty otherwise.
    reason: str = field("reason", omit="omitempty", default="")

    def chunk_reasons(self, i: int) -> list[str]:
        """Why failed[i] failed: every failed group's reason when the
        verdict carries them, else its one reason without the "chunk N: "
        prefix; [] for an index outside failed (Go ChunkReasons)."""
        if not 0 <= i < len(self.failed):
            return []
        if i < len(self.group_reasons):
            return list(self.group_reasons[i])
        if i < len(self.reasons):
            return [self.reasons[i].removeprefix(f"chunk {self.failed[i]}: ")]
        return []

    def validate(self) -> None:
        if self.state not in (VERDICT_PENDING, VERDICT_COMPLETE, VERDICT_FAILED, VERDICT_REFUSED):
            raise MalformedError(f"verdict {self.restore_id} has state {self.state!r}, want pending, complete, "
                                 "failed or refused")
        if self.state == VERDICT_COMPLETE and self.failed:
            raise MalformedError(f"verdict {self.restore_id} complete with {len(self.failed)} failed chunks")
        if self.state == VERDICT_REFUSED and (self.prefix != 0 or not self.reason or self.failed):
            raise MalformedError(f"verdict {self.restore_id} refused with prefix {self.prefix}, {len(self.failed)} "
                                 f"failed chunks and reason {self.reason!r}; want prefix 0, none and a reason")
        if self.state != VERDICT_REFUSED and self.reason:
            raise MalformedError(f"verdict {self.restore_id} is {self.state} with a refusal reason {self.reason!r}")
        if self.group_reasons and len(self.group_reasons) != len(self.failed):
            raise MalformedError(f"verdict {self.restore_id} has group reasons for {len(self.group_reasons)} chunks, "
                                 f"want one list per failed chunk ({len(self.failed)})")


@dataclass
class ReportAck:
    duplicate: bool = field("duplicate", omit="omitempty", default=False)
    state: str = field("state", default="")


@dataclass
class EventAck:
    applied_through: u64 = field("applied_through", default=0)
    resync: bool = field("resync", omit="omitempty", default=False)
    fenced: bool = field("fenced", omit="omitempty", default=False)


# ---------------------------------------------------------------- events


@dataclass
class Event:
    seq: u64 = field("seq", default=0)
    kind: u8 = field("kind", default=0)
    tier: u8 = field("tier", default=0)
    key: Key = field("key", default_factory=Key)
    size: u64 = field("size", default=0)
    sum: u64 = field("sum", default=0)


_BATCH_MAGIC = b"KVB1"
_EVENT_SIZE = 8 + 1 + 1 + KEY_SIZE + 8 + 8


@dataclass
class Batch:
    """A run of events from one rank incarnation. Binary encoding, big-endian:
    ``"KVB1" | u8 len(instance) | instance | u32 tp_rank | u64 incarnation |
    u32 n | n x (u64 seq | u8 kind | u8 tier | key (37 B) | u64 size | u64 sum)``."""

    rank: Rank = field("rank", default_factory=Rank)
    incarnation: u64 = field("incarnation", default=0)
    events: list[Event] = field("events", default_factory=list)

    def to_binary(self) -> bytes:
        inst = self.rank.instance.encode()
        if len(inst) > 255:
            raise MalformedError(f"instance name {len(inst)} bytes, limit 255")
        if len(self.events) > MAX_BATCH_EVENTS:
            raise MalformedError(f"batch of {len(self.events)} events, limit {MAX_BATCH_EVENTS}")
        out = bytearray(_BATCH_MAGIC)
        out.append(len(inst))
        out += inst
        out += struct.pack(">IQI", self.rank.tp_rank, self.incarnation, len(self.events))
        for e in self.events:
            out += struct.pack(">QBB", e.seq, int(e.kind), int(e.tier))
            out += e.key.to_binary()
            out += struct.pack(">QQ", e.size, e.sum)
        return bytes(out)

    @classmethod
    def from_binary(cls, p: bytes) -> Batch:
        def bad(msg: str) -> MalformedError:
            return MalformedError(f"event batch: {msg}")

        if len(p) < 5 or p[:4] != _BATCH_MAGIC:
            raise bad(f"missing magic {_BATCH_MAGIC!r}")
        n = p[4]
        p = p[5:]
        if len(p) < n + 16:
            raise bad("truncated header")
        try:
            inst = p[:n].decode()
        except UnicodeDecodeError:
            raise bad("instance name is not UTF-8") from None
        tp, inc, count = struct.unpack(">IQI", p[n:n + 16])
        p = p[n + 16:]
        if tp > MAX_TP:
            raise bad(f"TP rank {tp} exceeds {MAX_TP}")
        if count > MAX_BATCH_EVENTS:
            raise bad(f"{count} events, limit {MAX_BATCH_EVENTS}")
        if len(p) != count * _EVENT_SIZE:
            raise bad(f"{len(p)} bytes of events, want {count} x {_EVENT_SIZE}")
        events = []
        for i in range(count):
            q = p[i * _EVENT_SIZE:(i + 1) * _EVENT_SIZE]
            seq, kind, tier = struct.unpack(">QBB", q[:10])
            if kind not in (1, 2):
                raise bad(f"event {i}: kind {kind}")
            if tier not in (1, 2):
                raise bad(f"event {i}: tier {tier}")
            try:
                key = Key.from_binary(q[10:10 + KEY_SIZE])
            except MalformedError as e:
                raise bad(f"event {i}: {e}") from None
            size, sum_ = struct.unpack(">QQ", q[10 + KEY_SIZE:])
            events.append(Event(seq, EventKind(kind), Tier(tier), key, size, sum_))
        return cls(Rank(inst, tp), inc, events)


@dataclass
class Heartbeat:
    rank: Rank = field("rank", default_factory=Rank)
    incarnation: u64 = field("incarnation", default=0)
    seq: u64 = field("seq", default=0)
