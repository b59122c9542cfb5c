"""KvtierConnector: vLLM's KVConnectorBase_V1 on kvtier.

Load it with ``kv_transfer_config={"kv_connector": "KvtierConnector",
"kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvtier_nats":
"nats://...", "kvtier_instance": "engine0", "kvtier_creds_dir": "/etc/kvtier/creds"}}``. The connector connects as
engine-<instance> with that directory's seed (and ca.pem, if present);
``kvtier_nkey_seed_file`` / ``kvtier_tls_ca_file`` name them one by one.
Without credentials it refuses to start (``kvtier_insecure`` only for an
``--insecure`` coordinator).

Scheduler side: ``get_num_new_matched_tokens`` asks the coordinator's
lookup for the request's chunks (answering "not yet", None, while the
lookup is in flight; the answer is cached per request, so repeated calls
agree); ``update_state_after_alloc`` records what to load into which
blocks; ``build_connector_meta`` begins each restore at the coordinator
and lists the chunks to store that this step completes;
``request_finished`` keeps a request's blocks while stores may still read
them.

Worker side: ``register_kv_caches`` registers every layer's pool with the
worker's rankd (raw CUDA IPC handle plus offset); ``start_load_kv`` sends
this rank's part of every restore and waits for the coordinator's verdict;
only a complete verdict counts, and every block of a chunk that is not
confirmed goes to ``get_block_ids_with_load_errors`` so vLLM recomputes it;
``wait_for_save`` records one interprocess event per store (C1) after the
forward and sends the stores; ``get_finished`` reports a request once all
its stores have answered.

The spec comes from vLLM's kv_cache_config (see kvtier.vllm.spec) and
fails closed on layouts it does not understand.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

from kvtier import _codec, cuda, dcp, wire
from kvtier import client as kvclient
from kvtier.errors import GeometryError, KvtierError, UnknownNamespace, UnknownSession
from kvtier.vllm.spec import spec_from_vllm

log = logging.getLogger("kvtier.vllm")

try:  # the real base class when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except ImportError:  # a stand-in with the same constructor, for tests without vLLM
    import enum

    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata: Any = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata


@dataclass
class LoadSpec:
    """One restore for one request: the coordinator's plan (each rank's
    items as kvtier wire JSON) and the request's block ids."""

    req_id: str
    restore_id: str
    first_chunk: int  # chunk index in the request of the plan's chunk 0
    chunks: int  # chunks vLLM was told are loaded
    planned: int  # chunks the plan covers (<= chunks)
    items: dict[str, bytes]  # by str(Rank): JSON list of RetrieveItem
    block_ids: list[list[int]]  # [group][block] of the whole request
    problem: str = ""


@dataclass
class SaveSpec:
    """Chunks of one request that this step completes, to store."""

    req_id: str
    chunks: list[tuple[bytes, list[list[int]]]]  # (chunk hash, [group][block])


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Req:
    tokens: list[int]
    hashes: list[dcp.ChunkHash]
    lookup: concurrent.futures.Future[wire.LookupReply] | None = None
    lookup_first: int = -1
    matched_chunks: int | None = None  # lookup answer, chunks from lookup_first
    load: tuple[int, int] | None = None  # (first chunk, chunks) to load
    block_ids: list[list[int]] = field(default_factory=list)
    saved_through: int = 0  # chunks [0, saved_through) are stored or being stored
    saved_any: bool = False


@dataclass
class _Pending:
    fut: concurrent.futures.Future[wire.StoreReply]
    event: Any  # released once the store has answered (C1)
    chunks: tuple[bytes, ...] = ()  # names the store in a BlocksFreed
    in_use: bool = False  # answered blocks_in_use: held until BlocksFreed (C10)


@dataclass
class Config:
    """kv_connector_extra_config keys (all optional)."""

    nats: list[str]
    prefix: str
    instance: str
    model: str
    cache_salt: str
    chunk_tokens: int | None
    timeout_s: float
    lookup_wait_s: float
    restore_deadline_ms: int
    device: str  # "cuda" or "host"
    host_dir: str  # private (0700), default cuda.default_host_dir()
    host_uuid: str | None
    creds_dir: str | None  # from `coordinator init`: engine-<instance>.nk, ca.pem
    nkey_seed_file: str | None
    tls_ca_file: str | None
    inbox_prefix: str | None
    insecure: bool  # DEVELOPMENT ONLY: no credentials (an --insecure coordinator)
    pool_layout: str  # block_major | kv_split (kvtier.vllm.spec)

    @classmethod
    def of(cls, vllm_config: Any) -> Config:
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        model = extra.get("kvtier_model") or str(getattr(vllm_config.model_config, "model", "") or "")
        nats = extra.get("kvtier_nats", "nats://127.0.0.1:4222")
        chunk = extra.get("kvtier_chunk_tokens")
        c = cls(nats=[u for u in str(nats).split(",") if u], prefix=extra.get("kvtier_prefix", wire.DEFAULT_PREFIX),
                instance=extra.get("kvtier_instance", "engine0"), model=model,
                cache_salt=extra.get("kvtier_cache_salt", ""), chunk_tokens=int(chunk) if chunk else None,
                timeout_s=float(extra.get("kvtier_timeout_s", 30.0)),
                lookup_wait_s=float(extra.get("kvtier_lookup_wait_s", 0.05)),
                restore_deadline_ms=int(extra.get("kvtier_restore_deadline_ms", 10000)),
                device=extra.get("kvtier_device", "cuda"),
                host_dir=extra.get("kvtier_host_dir") or cuda.default_host_dir(),
                host_uuid=extra.get("kvtier_host_uuid"), creds_dir=extra.get("kvtier_creds_dir"),
                nkey_seed_file=extra.get("kvtier_nkey_seed_file"),
                tls_ca_file=extra.get("kvtier_tls_ca_file"), inbox_prefix=extra.get("kvtier_inbox_prefix"),
                insecure=str(extra.get("kvtier_insecure", "")).lower() in ("1", "true", "yes"),
                pool_layout=extra.get("kvtier_pool_layout", "block_major"))
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
        if policy is not None and policy != "recompute":
            # vLLM's default "fail" ends a request with an error when a load
            # fails; kvtier is a cache: a chunk it cannot restore must be
            # recomputed (get_block_ids_with_load_errors), never fatal.
            raise ValueError(f'kv_transfer_config kv_load_failure_policy "{policy}": the kvtier connector needs '
                             '"recompute" (a chunk kvtier cannot restore is recomputed, not an error for the request)')
        wire.valid_instance(c.instance)
        if c.device not in ("cuda", "host"):
            raise ValueError(f"kvtier_device {c.device!r}: want cuda or host")
        try:
            c.connect_options("kvtier-vllm").validate()
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: {e} (keys kvtier_creds_dir, kvtier_nkey_seed_file, "
                             f"kvtier_tls_ca_file; kvtier_insecure only for an --insecure coordinator)") from None
        return c

    def connect_options(self, name: str) -> kvclient.ConnectOptions:
        return kvclient.ConnectOptions(servers=self.nats, name=name, prefix=self.prefix, timeout=self.timeout_s,
                                       instance=self.instance, creds_dir=self.creds_dir,
                                       nkey_seed_file=self.nkey_seed_file, tls_ca_file=self.tls_ca_file,
                                       inbox_prefix=self.inbox_prefix, insecure=self.insecure)

    def host_device(self) -> cuda.HostDevice:
        """The host backend device of kvtier_device=host: host_dir (created
        0700 when it is the default) must be private, as rankd requires."""
        return cuda.HostDevice(self.host_dir, self.host_uuid)


class KvtierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector storing and restoring through kvtier."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = Config.of(vllm_config)
        par = vllm_config.parallel_config
        self.tp = int(getattr(par, "tensor_parallel_size", 1))
        dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
        pcp_size = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
        interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)
        pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
        if kv_cache_config is None:
            raise GeometryError("KvtierConnector needs vLLM's kv_cache_config (vLLM >= 0.11 passes it)")
        self.spec, self.layers = spec_from_vllm(kv_cache_config, self.cfg.model, self.cfg.cache_salt, self.tp,
                                                dcp_size, pp, self.cfg.chunk_tokens, self.cfg.pool_layout,
                                                interleave=interleave, pcp_size=pcp_size)
        self.resolved = self.spec.resolve()
        self.chunk = self.spec.chunk_tokens
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0))
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        self._client: kvclient.SyncClient | None = None
        self.stats = {"lookups": 0, "lookup_errors": 0, "loaded_tokens": 0, "restores": 0, "restore_failures": 0,
                      "load_error_blocks": 0, "stores": 0, "stored_objects": 0, "store_failures": 0,
                      "reregistered": 0, "blocks_in_use": 0}
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._registered_spec = False
        # worker side
        self._session: kvclient.SyncRankSession | None = None
        self._device_uuid = ""
        self._pending: dict[str, list[_Pending]] = {}
        self._saving: set[str] = set()
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._freed_lock = threading.Lock()
        self._freed: set[tuple[str, tuple[bytes, ...]]] = set()  # guarded by _freed_lock
        self._rank = wire.Rank(self.cfg.instance, 0)
        self._host: cuda.HostDevice | None = None
        self._host_mems: list[cuda.HostMem] = []  # kvtier_device=host: the pools, alive as long as vLLM's tensors
        log.info("kvtier connector %s: namespace %s, %d groups, chunk %d tokens, TP %d, DCP %d (interleave %d)",
                 "scheduler" if self.is_scheduler else "worker", self.resolved.namespace, len(self.spec.groups),
                 self.chunk, self.tp, dcp_size, interleave)

    # ---------------------------------------------------------------- seams

    def _make_client(self) -> kvclient.SyncClient:
        role = "scheduler" if self.is_scheduler else f"worker{self._tp_rank()}"
        return kvclient.SyncClient(self.cfg.connect_options(f"kvtier-vllm-{self.cfg.instance}-{role}"))

    def _tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore[import-not-found]

        return int(get_tensor_model_parallel_rank())

    def _check_layout(self, gi: int, layer: str, tensor: Any) -> None:
        """Refuses a layer tensor whose layout is not the configured one:
        block-major with the declared page as the block stride, or K/V split
        (2, num_blocks, ...) with half pages."""
        gl = self.layers[gi]
        isz = tensor.element_size()
        nbytes = tensor.numel() * isz
        shape = tuple(tensor.shape)
        if gl.kv_split:
            ok = (len(shape) >= 2 and shape[0] == 2 and shape[1] == self.num_blocks
                  and tensor.stride(1) * isz == gl.page_bytes // 2
                  and tensor.stride(0) * isz == self.num_blocks * gl.page_bytes // 2)
            want = f"(2, {self.num_blocks}, ...) K/V halves of {gl.page_bytes // 2} B pages"
        else:
            ok = len(shape) >= 1 and shape[0] == self.num_blocks and tensor.stride(0) * isz == gl.page_bytes
            want = (f"{self.num_blocks} blocks of page_size_bytes {gl.page_bytes} B, block-major "
                    "(FlashInfer/MLA/Mamba; FlashAttention's K/V split needs kvtier_pool_layout=kv_split)")
        if not ok or nbytes != self.num_blocks * gl.page_bytes:
            strides = tuple(tensor.stride(d) * isz for d in range(len(shape)))
            raise GeometryError(f"layer {layer} (group {gi}): tensor of shape {shape}, {nbytes} B, byte strides "
                                f"{strides}; kvtier needs {want}")

    def _pool_handles(self, gi: int, layer: str, tensor: Any) -> list[cuda.MemHandle]:
        """The MemHandles of one layer's pools (one, or K then V) after
        checking the layout."""
        self._check_layout(gi, layer, tensor)
        if self.cfg.device == "host":
            return self._host_pool_handles(layer, tensor, self.layers[gi].kv_split)
        if self.layers[gi].kv_split:
            return [cuda.mem_handle_from_torch(tensor[0]), cuda.mem_handle_from_torch(tensor[1])]
        return [cuda.mem_handle_from_torch(tensor)]

    def _host_dev(self) -> cuda.HostDevice:
        if self._host is None:
            self._host = self.cfg.host_device()
        return self._host

    def _host_pool_handles(self, layer: str, tensor: Any, kv_split: bool) -> list[cuda.MemHandle]:
        """kvtier_device=host (vLLM's CPU backend): moves a CPU layer tensor
        into a host-backend allocation, in place, so that the rankd reads and
        writes the very pages vLLM computes with. The contents are copied
        and the tensor keeps its shape and strides (``set_`` swaps its
        storage: every reference vLLM holds to the tensor sees the new
        memory). _check_layout has made sure the tensor is dense."""
        import torch  # type: ignore[import-not-found]

        if tensor.device.type != "cpu":
            raise GeometryError(f"layer {layer}: kvtier_device=host needs CPU tensors (vLLM's CPU backend), "
                                f"got a tensor on {tensor.device}; use kvtier_device=cuda on a GPU")
        nbytes = tensor.numel() * tensor.element_size()
        mem = self._host_dev().alloc(nbytes)
        self._host_mems.append(mem)
        raw = torch.frombuffer(mem.buf, dtype=torch.uint8, count=nbytes)
        moved = torch.as_strided(raw.view(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), 0)
        moved.copy_(tensor)
        with torch.no_grad():
            tensor.set_(moved.untyped_storage(), 0, tuple(tensor.shape), tuple(tensor.stride()))
        if kv_split:
            return [mem.export(0, nbytes // 2), mem.export(nbytes // 2, nbytes // 2)]
        return [mem.export(0, nbytes)]

    def _new_event(self) -> tuple[Any, cuda.EventHandle]:
        """A fresh interprocess event recorded after the forward on the
        current stream, and its handle. The object is kept until the store
        answers, then dropped (release() when it has one). On the host
        backend the forward has finished when wait_for_save runs (CPU work
        is synchronous), so the event is recorded completed."""
        if self.cfg.device == "host":
            hev = self._host_dev().new_event()
            hev.record()
            return hev, hev.export()
        import torch  # type: ignore[import-not-found]

        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream())
        return ev, cuda.event_handle_from_torch(ev, self._device_uuid)

    @property
    def client(self) -> kvclient.SyncClient:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    # ---------------------------------------------------------------- scheduler

    def _ensure_spec(self) -> None:
        if not self._registered_spec:
            self.client.register_spec(self.spec)
            self._registered_spec = True

    def _req(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            st = _Req(tokens, self.resolved.chunk_hashes(tokens))
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._req(request)
        if num_computed_tokens % self.chunk:
            return 0, False  # kvtier restores whole chunks only
        first = num_computed_tokens // self.chunk
        last = max(0, (len(st.tokens) - 1) // self.chunk)  # vLLM must compute at least one token
        last = min(last, len(st.hashes))
        if first >= last:
            return 0, False
        if st.lookup_first != first:
            st.lookup, st.lookup_first, st.matched_chunks = None, first, None
        if st.matched_chunks is None:
            if st.lookup is None:
                try:
                    self._ensure_spec()
                    st.lookup = self.client.submit(self.client.aio.lookup(
                        self.resolved.namespace, st.hashes[first:last], self.cfg.instance))
                except KvtierError as e:
                    log.warning("kvtier lookup for %s not sent: %s", request.request_id, e)
                    self.stats["lookup_errors"] += 1
                    st.matched_chunks = 0
                    return 0, False
                self.stats["lookups"] += 1
            try:
                rep = st.lookup.result(timeout=self.cfg.lookup_wait_s)
            except concurrent.futures.TimeoutError:
                return None, False  # not yet: vLLM asks again
            except Exception as e:
                log.warning("kvtier lookup for %s failed: %s", request.request_id, e)
                self.stats["lookup_errors"] += 1
                st.matched_chunks = 0
            else:
                st.matched_chunks = 0 if rep.not_alive else rep.prefix
        n = min(st.matched_chunks, last - first)
        return n * self.chunk, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._req(request)
        st.block_ids = [list(b) for b in blocks.get_block_ids()]
        if num_external_tokens > 0:
            if num_external_tokens % self.chunk or st.lookup_first < 0:
                raise GeometryError(f"request {request.request_id}: {num_external_tokens} external tokens, "
                                    f"not whole chunks of {self.chunk} from a lookup")
            st.load = (st.lookup_first, num_external_tokens // self.chunk)

    def _chunk_blocks(self, st: _Req, c: int) -> list[list[int]] | None:
        out = []
        for gi, _ in enumerate(self.spec.groups):
            bpc = self.resolved.blocks_per_chunk(gi)
            ids = st.block_ids[gi] if gi < len(st.block_ids) else []
            if len(ids) < (c + 1) * bpc:
                return None
            out.append(ids[c * bpc:(c + 1) * bpc])
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata()
        for req_id, st in self._reqs.items():
            if st.load is None:
                continue
            first, n = st.load
            st.load = None
            meta.loads.append(self._begin_restore(req_id, st, first, n))
            st.saved_through = max(st.saved_through, first + n)
        num_sched = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            nst = self._reqs.get(new.req_id)
            if nst is None:
                continue  # never asked about (get_num_new_matched_tokens runs first)
            nst.block_ids = [list(b) for b in new.block_ids]
            self._plan_saves(meta, new.req_id, nst, new.num_computed_tokens + num_sched.get(new.req_id, 0))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            flags = getattr(cached, "resumed_from_preemption", None)
            for i, req_id in enumerate(cached.req_ids):
                cst = self._reqs.get(req_id)
                if cst is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in resumed or (flags is not None and flags[i]):
                    cst.block_ids = [list(b) for b in (new_ids or ())]
                elif new_ids is not None:
                    for gi, b in enumerate(new_ids):
                        while len(cst.block_ids) <= gi:
                            cst.block_ids.append([])
                        cst.block_ids[gi].extend(b)
                self._plan_saves(meta, req_id, cst, cached.num_computed_tokens[i] + num_sched.get(req_id, 0))
        return meta

    def _plan_saves(self, meta: KvtierConnectorMetadata, req_id: str, st: _Req, computed: int) -> None:
        done = min(computed, len(st.tokens)) // self.chunk
        chunks: list[tuple[bytes, list[list[int]]]] = []
        c = st.saved_through
        while c < done:
            blocks = self._chunk_blocks(st, c)
            if blocks is None:
                log.warning("request %s chunk %d: blocks not allocated; not stored", req_id, c)
                break
            chunks.append((bytes(st.hashes[c]), blocks))
            c += 1
        st.saved_through = c
        if chunks:
            meta.saves.append(SaveSpec(req_id, chunks))
            st.saved_any = True

    def _begin_restore(self, req_id: str, st: _Req, first: int, n: int) -> LoadSpec:
        spec = LoadSpec(req_id, "", first, n, 0, {}, [list(b) for b in st.block_ids])
        try:
            plan = self.client.restore_begin(self.resolved.namespace, st.hashes[first:first + n], self.cfg.instance,
                                             self.cfg.restore_deadline_ms)
        except Exception as e:
            spec.problem = f"restore.begin: {e}"
            log.warning("kvtier restore for %s not begun: %s", req_id, e)
            return spec
        spec.restore_id, spec.planned = plan.restore_id, min(plan.prefix, n)
        spec.items = {r: _codec.dumps([_codec.to_obj(it) for it in items])
                      for r, items in plan.ranks.items()}
        if plan.prefix < n:
            spec.problem = f"plan covers {plan.prefix} of {n} chunks ({plan.reason})"
        return spec

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        return (st is not None and st.saved_any), None

    # ---------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._rank = wire.Rank(self.cfg.instance, self._tp_rank())
        pools: list[wire.PoolRegistration] = []
        for gi, gl in enumerate(self.layers):
            for li, name in enumerate(gl.layer_names):
                if name not in kv_caches:
                    raise GeometryError(f"kv_caches has no tensor for layer {name} of group {gi}")
                hs = self._pool_handles(gi, name, kv_caches[name])
                want = 2 if gl.kv_split else 1
                if len(hs) != want:
                    raise GeometryError(f"layer {name} (group {gi}): {len(hs)} pools, want {want}")
                for j, h in enumerate(hs):
                    pools.append(wire.PoolRegistration(gi, li * want + j, h))
        uuids = {p.handle.device for p in pools}
        if len(uuids) != 1:
            raise GeometryError(f"pools on {len(uuids)} devices {sorted(uuids)}, want one")
        self._device_uuid = uuids.pop()
        self._session = self.client.register(self._rank, self.spec, self._device_uuid, pools)
        self._session.on_freed(self._on_freed)
        self._incarnation = self._rank_incarnation()
        log.info("kvtier: registered %d pools with rankd %s", len(pools), self._rank)

    def _rank_incarnation(self) -> int:
        try:
            return int(self.client.status(self._rank).incarnation)
        except Exception as e:
            log.warning("kvtier: status of rankd %s: %s", self._rank, e)
            return 0

    def _ensure_registered(self) -> None:
        """Registers the pools again when the rankd restarted (a new
        incarnation forgets registrations), before this step's loads or
        stores reach it. One status request per step that has work."""
        assert self._session is not None
        inc = self._rank_incarnation()
        if inc == 0 or inc == self._incarnation:
            return
        try:
            self._session.reregister()
        except Exception as e:
            log.warning("kvtier: register again with rankd %s (incarnation %d): %s", self._rank, inc, e)
            return
        log.info("kvtier: rankd %s restarted (incarnation %d); pools registered again", self._rank, inc)
        self.stats["reregistered"] += 1
        self._incarnation = inc

    def _store_chunks(self, save: SaveSpec) -> list[wire.ChunkBlocks]:
        tp = self._rank.tp_rank
        out = []
        for h, blocks in save.chunks:
            per_group = [blocks[gi] if self.resolved.store_shard(gi, tp) is not None else []
                         for gi in range(len(self.spec.groups))]
            if any(per_group):
                out.append(wire.ChunkBlocks(dcp.ChunkHash(h), per_group))
        return out

    async def _store(self, req_id: str, chunks: list[wire.ChunkBlocks], handle: cuda.EventHandle) -> wire.StoreReply:
        assert self._session is not None
        s = self._session.aio
        try:
            return await s.store(req_id, chunks, handle)
        except (UnknownNamespace, UnknownSession):
            # A restarted rankd forgot the registration: register again.
            # (Never on StaleSession: another process of the instance took
            # the pools; registering again would take them back.)
            await s.reregister()
            self.stats["reregistered"] += 1
            return await s.store(req_id, chunks, handle)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._session is None:
            return
        meta = cast(KvtierConnectorMetadata, self._get_connector_metadata())
        if meta.saves:
            self._ensure_registered()
        for save in meta.saves:
            self._saving.add(save.req_id)
            chunks = self._store_chunks(save)
            if not chunks:
                continue  # this rank stores no shard of these chunks (MLA)
            ev, handle = self._new_event()
            fut = self.client.submit(self._store(save.req_id, chunks, handle))
            key = tuple(bytes(c.chunk) for c in chunks)
            self._pending.setdefault(save.req_id, []).append(_Pending(fut, ev, key))
            self.stats["stores"] += 1

    def _on_freed(self, msg: wire.BlocksFreed) -> None:
        with self._freed_lock:
            self._freed.add((msg.request_id, tuple(bytes(c) for c in msg.chunks)))

    def _take_freed(self, req_id: str, chunks: tuple[bytes, ...]) -> bool:
        with self._freed_lock:
            if (req_id, chunks) in self._freed:
                self._freed.discard((req_id, chunks))
                return True
            return False

    def _reap(self) -> None:
        for req_id, pend in list(self._pending.items()):
            keep = []
            for p in pend:
                if not p.fut.done():
                    keep.append(p)
                    continue
                if p.in_use:
                    if not self._take_freed(req_id, p.chunks):
                        keep.append(p)
                        continue
                else:
                    try:
                        rep = p.fut.result()
                    except Exception as e:
                        self.stats["store_failures"] += 1
                        log.warning("kvtier store for %s failed: %s", req_id, e)
                    else:
                        self.stats["stored_objects"] += rep.stored
                        if rep.failed:
                            self.stats["store_failures"] += 1
                            log.warning("kvtier store for %s: failed objects %s", req_id, rep.failed)
                        if rep.blocks_in_use and not self._take_freed(req_id, p.chunks):
                            # C10: the device may still read the blocks. The
                            # request keeps them (vLLM does not free them) and
                            # the event lives until the rankd says BlocksFreed.
                            log.warning("kvtier store for %s: blocks still in use; held until freed", req_id)
                            self.stats["blocks_in_use"] += 1
                            p.in_use = True
                            keep.append(p)
                            continue
                rel = getattr(p.event, "release", None)
                if callable(rel):
                    rel()
            if keep:
                self._pending[req_id] = keep
            else:
                del self._pending[req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finishing |= {r for r in finished_req_ids if r in self._saving}
        self._reap()
        done = {r for r in self._finishing if r not in self._pending}
        self._finishing -= done
        self._saving -= done
        return (done or None), None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata() or self._session is None:
            return
        meta = cast(KvtierConnectorMetadata, self._get_connector_metadata())
        if meta.loads:
            self._ensure_registered()
        futs = [(load, self.client.submit(self._load(load))) for load in meta.loads]
        for load, fut in futs:
            try:
                loaded = fut.result(self.cfg.timeout_s + self.cfg.restore_deadline_ms / 1000 + 5)
            except Exception as e:
                log.warning("kvtier restore %s for %s: %s", load.restore_id, load.req_id, e)
                loaded = 0
            self.stats["restores"] += 1
            if loaded < load.chunks:
                self.stats["restore_failures"] += 1
            self.stats["loaded_tokens"] += loaded * self.chunk
            for c in range(load.first_chunk + loaded, load.first_chunk + load.chunks):
                for gi in range(len(self.spec.groups)):
                    bpc = self.resolved.blocks_per_chunk(gi)
                    ids = load.block_ids[gi][c * bpc:(c + 1) * bpc]
                    self._load_errors.update(ids)
                    self.stats["load_error_blocks"] += len(ids)

    async def _load(self, load: LoadSpec) -> int:
        """This rank's part of one restore; returns the chunks confirmed by
        the verdict (only a complete verdict confirms all of them)."""
        assert self._session is not None
        if not load.restore_id:
            return 0
        raw = load.items.get(str(self._rank))
        if raw:
            items = [_codec.from_obj(wire.RetrieveItem, x, "item") for x in _codec.loads(raw)]
            for it in items:
                c = load.first_chunk + it.chunk
                bpc = self.resolved.blocks_per_chunk(it.group)
                it.blocks = load.block_ids[it.group][c * bpc:(c + 1) * bpc]
            try:
                try:
                    await self._session.aio.retrieve(items, load.restore_id)
                except (UnknownNamespace, UnknownSession):
                    # A restarted rankd forgot the registration. Its report
                    # of the refusal may already have failed the restore:
                    # register again for the next one; the verdict decides.
                    await self._session.aio.reregister()
                    self.stats["reregistered"] += 1
                    await self._session.aio.retrieve(items, load.restore_id)
            except Exception as e:  # the verdict decides
                log.warning("kvtier retrieve of %s on %s: %s", load.restore_id, self._rank, e)
        verdict = await self.client.aio.restore_wait(load.restore_id)
        plan = wire.RestorePlan(load.restore_id, load.planned)
        return kvclient.restore_outcome(plan, verdict).loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # everything is placed in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are stored after the forward (wait_for_save)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._client is None:
            return
        if self._session is not None:
            for pend in self._pending.values():
                for p in pend:
                    try:
                        p.fut.result(self.cfg.timeout_s)
                    except Exception as e:
                        log.warning("kvtier store at shutdown: %s", e)
            try:
                self._session.release()
            except Exception as e:
                log.warning("kvtier release at shutdown: %s", e)
        self._client.close()
        self._client = None


__all__ = ["HAVE_VLLM", "KvtierConnector", "KvtierConnectorMetadata", "LoadSpec", "SaveSpec"]
