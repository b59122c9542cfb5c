"""Small fakes of the vLLM objects the connector reads (attribute names as
in vLLM's source: kv_cache_interface.py, sched/output.py, request.py) and of
kvtier's client, for tests without vLLM or daemons."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier import client, client_plan, dcp, wire
from kvtier.errors import BadRequest


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


BF16 = DType("bfloat16", 2)
FP8 = DType("float8_e4m3fn", 1)


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DType
    page_size_padded: int | None = None
    kv_quant_mode: int = 0
    dcp_sharded: bool = True  # vLLM's AttentionSpec default
    non_causal: bool = False

    @property
    def real_page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None

    @property
    def real_page_size_bytes(self) -> int:
        if self.cache_dtype_str == "fp8_ds_mla":
            return self.block_size * 656
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 128


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 64


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DType, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"

    @property
    def page_size_bytes(self) -> int:
        n = sum(dt.itemsize * _prod(s) for s, dt in zip(self.shapes, self.dtypes, strict=True))
        return self.page_size_padded or n


def _prod(s: tuple[int, ...]) -> int:
    out = 1
    for x in s:
        out *= x
    return out


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]


@dataclass
class KVTransferConfig:
    kv_connector: str = "KvtierConnector"
    kv_connector_module_path: str = "kvtier.vllm"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # vLLM >= 0.2x: "fail" (its default) ends a request whose load failed
    # with an error; the connector needs "recompute"
    kv_load_failure_policy: str = "fail"


@dataclass
class ModelConfig:
    model: str = "tiny-llama"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1


@dataclass
class SchedulerConfig:
    async_scheduling: bool = False  # vLLM's default on CPUs (on GPUs: True)


@dataclass
class VllmConfig:
    kv_transfer_config: KVTransferConfig
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    use_v2_model_runner: bool = False
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)


def vllm_config(tp: int = 1, policy: str = "recompute", pp: int = 1, **extra: Any) -> VllmConfig:
    return VllmConfig(KVTransferConfig(kv_connector_extra_config=extra, kv_load_failure_policy=policy),
                      parallel_config=ParallelConfig(tp, pipeline_parallel_size=pp))


def attention_config(num_blocks: int = 64, layers: int = 2, block_size: int = 16,
                     first_layer: int = 0) -> KVCacheConfig:
    """One full-attention group of `layers` layers from first_layer (a
    pipeline stage's config starts at its first layer)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(first_layer, first_layer + layers)]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=BF16)
    return KVCacheConfig(num_blocks, [KVCacheTensor(num_blocks * spec.page_size_bytes, [n]) for n in names],
                         [KVCacheGroupSpec(names, spec)])


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None  # vLLM's per-request salt (Request.cache_salt)


@dataclass
class KVCacheBlocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None  # vLLM >= 0.32 names them


@dataclass
class Tensor:
    """The few tensor methods the connector's layout check reads."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    handle: Any = None

    def numel(self) -> int:
        return _prod(self.shape)

    def element_size(self) -> int:
        return self.itemsize

    def stride(self, d: int) -> int:
        return self.strides[d]


class FakeSession:
    def __init__(self, rank: wire.Rank, ns: dcp.Namespace, world: FakeWorld) -> None:
        self.rank, self.namespace, self.world = rank, ns, world

    async def store(self, request_id, chunks, event, *, timeout=None, deadline=None, gather_limit=None):
        self.world.stores.append((self.rank, request_id, chunks, event))
        self.world.store_deadlines.append(deadline)
        self.world.store_gather_limits.append(gather_limit)
        gate = self.world.store_gate
        if gate is not None:
            cut = self.world.cut_gates.setdefault(request_id, concurrent.futures.Future())
            await asyncio.wait([asyncio.wrap_future(gate), asyncio.wrap_future(cut)],
                               return_when=asyncio.FIRST_COMPLETED)
            if cut.done():  # cut before its gather: its objects failed, as the rankd answers
                return wire.StoreReply(stored=0, failed=[bytes(c.chunk).hex() for c in chunks])
        if self.world.store_error is not None:
            raise self.world.store_error
        if self.world.store_reply is not None:
            return self.world.store_reply
        return wire.StoreReply(stored=len(chunks))

    async def cut(self, request_id, *, through=None, timeout=None):
        self.world.cuts.append((self.rank, request_id))
        self.world.cut_throughs.append(through)
        if not self.world.cut_answers:
            return 0  # a rankd whose stores have begun their gather: nothing cut
        gate = self.world.cut_gates.setdefault(request_id, concurrent.futures.Future())
        if not gate.done():
            gate.set_result(None)
        return 1

    async def retrieve(self, items, restore_id="", *, timeout=None, deadline=None):
        self.world.retrieves.append((self.rank, restore_id, items))
        self.world.retrieve_deadlines.append(deadline)
        if self.world.retrieve_error is not None:
            raise self.world.retrieve_error
        return wire.RetrieveReply([wire.ItemResult(it.chunk, it.group, True) for it in items])

    async def retrieve_packed(self, items, restore_id, block_ids, blocks_per_chunk, *, first_chunk=0, skip=(),
                              timeout=None, deadline=None, pace=None):
        self.world.retrieve_paces.append(pace)
        # The bytes the real session sends, decoded as a rankd would: the
        # tests see the items and blocks the worker asked for.
        body = items.retrieve_request(restore_id, "fake-session", block_ids, blocks_per_chunk, first_chunk, skip)
        req = wire.RetrieveRequest.from_binary(body)
        assert req.namespace == items.namespace or not req.items, (req.namespace, items.namespace)
        await self.retrieve(req.items, restore_id, timeout=timeout, deadline=deadline)

    async def reregister(self):
        self.world.reregistered += 1

    async def on_freed(self, handler):
        self.world.freed_handlers.append(handler)

    async def release(self):
        self.world.released += 1


class FakeWorld:
    """What the fake coordinator and rankds know and were asked."""

    def __init__(self) -> None:
        self.prefix = 0
        self.lookup_gate: Any = None
        self.lookups: list[wire.LookupRequest] = []
        self.lookup_error: Exception | None = None
        self.begins: list[tuple[dcp.Namespace, list[dcp.ChunkHash], str]] = []
        self.begins_state_at_end: list[bool] = []  # each begin's state_at_end, by begin
        self.plan: wire.RestorePlan | None = None
        self.begin_error: Exception | None = None
        self.verdict: wire.RestoreVerdict | None = None
        self.verdict_gate: Any = None  # a Future: restore_wait answers once it is done
        self.stores: list[Any] = []
        self.store_gate: Any = None
        self.store_error: Exception | None = None
        self.store_reply: wire.StoreReply | None = None
        self.freed_handlers: list[Any] = []
        self.retrieves: list[Any] = []
        self.retrieve_deadlines: list[float | None] = []
        self.retrieve_paces: list[int | None] = []
        self.store_deadlines: list[float | None] = []
        self.store_gather_limits: list[float | None] = []
        self.retrieve_error: Exception | None = None
        self.registered: list[Any] = []
        self.reregistered = 0
        self.incarnation = 1
        self.released = 0
        self.specs: list[dcp.Spec] = []
        self.status_error: Exception | None = None
        # Per namespace / restore (pipeline stages: a namespace each); the
        # single values above answer whatever is not named here.
        self.prefix_by_ns: dict[dcp.Namespace, int] = {}
        self.plan_by_ns: dict[dcp.Namespace, wire.RestorePlan] = {}
        self.verdict_by_id: dict[str, wire.RestoreVerdict] = {}
        self.lookup_begins = 0  # begins that were also the lookup (RestoreBeginRequest.Lookup)
        self.refuse_lookup_begins = False  # a coordinator from before Lookup: refuses them
        self.waits: list[tuple[str, str | None]] = []  # (restore id, instance) of each restore_wait
        self.cancels: list[tuple[str, str | None]] = []  # (restore id, instance) of each restore_cancel
        self.cuts: list[tuple[wire.Rank, str]] = []  # (rank, request id) of each cut
        self.cut_throughs: list[float | None] = []  # each cut's deadline bound
        self.cut_answers = True  # a cut ends the request's stores held at store_gate
        self.cut_gates: dict[str, Any] = {}


class FakeAio:
    def __init__(self, world: FakeWorld) -> None:
        self.world = world

    connected = True

    async def lookup(self, namespace, chunks, *, instance=None, detail=False, timeout=None, state_at_end=False):
        self.world.lookups.append(wire.LookupRequest(namespace, list(chunks), instance, state_at_end=state_at_end))
        if self.world.lookup_gate is not None:
            await asyncio.wrap_future(self.world.lookup_gate)
        if self.world.lookup_error is not None:
            raise self.world.lookup_error
        prefix = self.world.prefix_by_ns.get(namespace, self.world.prefix)
        return wire.LookupReply(instance=instance, prefix=min(prefix, len(chunks)))

    async def restore_begin(self, namespace, chunks, *, instance=None, deadline_ms=0, timeout=None,
                            state_at_end=False):
        self.world.begins.append((namespace, list(chunks), instance))
        self.world.begins_state_at_end.append(state_at_end)
        if self.world.begin_error is not None:
            raise self.world.begin_error
        plan = self.world.plan_by_ns.get(namespace, self.world.plan)
        assert plan is not None
        return plan

    async def restore_begin_packed(self, namespace, chunks, *, instance=None, deadline_ms=0, timeout=None,
                                   state_at_end=False, lookup=False):
        if lookup:
            # The coordinator looks the chunks up and begins the restore of
            # the prefix found, in one request: as a lookup, then a begin.
            self.world.lookup_begins += 1
            if self.world.refuse_lookup_begins:
                raise BadRequest("bad_request", 'json: unknown field "lookup"')
            rep = await self.lookup(namespace, chunks, instance=instance, timeout=timeout, state_at_end=state_at_end)
            if rep.prefix == 0:
                return client_plan.PackedPlan("", 0, {})
            chunks = list(chunks)[:rep.prefix]
        p = await self.restore_begin(namespace, chunks, instance=instance, deadline_ms=deadline_ms, timeout=timeout,
                                     state_at_end=state_at_end)
        return client_plan.PackedPlan(p.restore_id, p.prefix,
                                      {name: client_plan.PlanItems.of(items) for name, items in p.ranks.items()},
                                      p.reason)

    async def restore_cancel(self, restore_id, *, timeout=None, instance=None):
        self.world.cancels.append((restore_id, instance))
        return wire.CancelReply(True, wire.VERDICT_FAILED)

    async def restore_wait(self, restore_id, *, timeout=None, instance=None):
        self.world.waits.append((restore_id, instance))
        if self.world.verdict_gate is not None:
            await asyncio.wrap_future(self.world.verdict_gate)
        v = self.world.verdict_by_id.get(restore_id, self.world.verdict)
        assert v is not None and v.restore_id == restore_id
        return v


class FakeSyncClient(client.SyncClient):
    """SyncClient's loop thread and facade over fake coordinator/rankds."""

    def __init__(self, world: FakeWorld) -> None:
        self.opts = client.ConnectOptions()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._closed = False
        self.world = world
        self.aio = FakeAio(world)  # type: ignore[assignment]

    def register_spec(self, spec):
        self.world.specs.append(spec)
        return spec.resolve().namespace

    def register(self, rank, spec, device_uuid, pools):
        self.world.registered.append((rank, device_uuid, list(pools)))
        return client.SyncRankSession(self, FakeSession(rank, spec.resolve().namespace, self.world))  # type: ignore[arg-type]

    def status(self, rank, *, timeout=None):
        if self.world.status_error is not None:
            raise self.world.status_error
        return wire.StatusReply(rank=rank, tp_size=1, incarnation=self.world.incarnation, accepting=True)

    def close(self):
        self._stop()
