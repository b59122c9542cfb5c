"""What both sides of KvtierConnector share: the geometry read from vLLM's
kv_cache_config, the counters, every field of the connector's state, and
the background link (kvtier.vllm.attach, C11) through which each side
reaches kvtier. The scheduler side (kvtier.vllm._scheduler) and the worker
side (kvtier.vllm._worker) build on it; kvtier.vllm.connector joins them
into the class vLLM loads."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtier import client as kvclient
from kvtier import cuda, wire
from kvtier.errors import GeometryError
from kvtier.vllm import _base
from kvtier.vllm._base import KVConnectorBase_V1, KVConnectorRole
from kvtier.vllm._state import _Loading, _Pending, _Req
from kvtier.vllm.attach import Link
from kvtier.vllm.spec import spec_from_vllm, stage_instance, stage_specs

if TYPE_CHECKING:
    from kvtier.vllm.connector import Config

log = logging.getLogger("kvtier.vllm")


def sync_loads_unsafe(vllm_config: Any) -> str:
    """Why vLLM, as configured, cannot take a failed synchronous load back
    ("" when it can). Seen on the H200 with vLLM 0.26 and the
    "recompute" failure policy: on the V2 model runner the recomputed
    request generated other tokens than vLLM alone (vLLM issue #49250); on
    the V1 runner with asynchronous scheduling (vLLM's default on GPUs) the
    engine stopped producing output. vLLM rewinds a running request's
    computed tokens when its synchronous load fails, while with
    asynchronous scheduling the next step, built on the old count, is
    already scheduled (vLLM issue #34484)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "vLLM's V2 model runner recomputes a failed synchronous load wrongly (vLLM issue #49250)"
    if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        return ("vLLM's asynchronous scheduling (its default on GPUs) has the next step scheduled when a "
                "synchronous load fails (vLLM issue #34484); set async_scheduling=False to load synchronously")
    return ""


class _Core(KVConnectorBase_V1):  # type: ignore[misc]
    """The connector's state and its link; no vLLM hook lives here."""

    def _init_state(self, cfg: Config, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        """Reads the geometry and sets up the state of both sides (a
        connector serves one role, but every field exists on either).
        KvtierConnector.__init__ calls it after vLLM's base __init__."""
        unsafe = sync_loads_unsafe(vllm_config)
        if not cfg.load_async and unsafe:
            # A failed synchronous load is recomputed wrongly there (tokens
            # unlike vLLM alone's, or an engine that stops stepping), while
            # the asynchronous path is right: a setting never buys that.
            log.warning("kvtier_load_async false is not honoured: %s; loads are asynchronous", unsafe)
            cfg = dataclasses.replace(cfg, load_async=True)
        self.cfg = cfg
        par = vllm_config.parallel_config
        self.tp = int(getattr(par, "tensor_parallel_size", 1))
        dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
        pcp_size = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
        interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)
        pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
        if kv_cache_config is None:
            raise GeometryError("KvtierConnector needs vLLM's kv_cache_config (vLLM >= 0.11 passes it)")
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        # Pipeline parallel: this side's stage (the scheduler's config is
        # stage 0's: vLLM's generate_scheduler_kv_cache_config).
        self.pp, self.pp_stage = pp, 0 if self.is_scheduler or pp == 1 else self._pp_rank()
        self.spec, self.layers = spec_from_vllm(kv_cache_config, self.cfg.model, self.cfg.cache_salt, self.tp,
                                                dcp_size, pp, self.cfg.chunk_tokens, self.cfg.pool_layout,
                                                interleave=interleave, pcp_size=pcp_size, pp_stage=self.pp_stage)
        self.resolved = self.spec.resolve()
        # Every stage's spec (kvtier.vllm.spec: a stage is a world of its
        # own), derived the same way on both sides; a worker checks that
        # the one derived for its stage is its own.
        self.stages = [s.resolve() for s in
                       stage_specs(self.spec, self.layers, self._stage_layer_counts(vllm_config, pp))]
        if self.stages[self.pp_stage].fingerprint != self.resolved.fingerprint:
            raise GeometryError(f"pipeline stage {self.pp_stage}: the spec derived from vLLM's layer partition is not "
                                "the one this stage's kv_cache_config gives; refusing PP > 1 for this model")
        self.instances = [stage_instance(self.cfg.instance, pp, st) for st in range(pp)]
        self.chunk = self.spec.chunk_tokens
        # Several groups: vLLM takes a failed load only per request
        # (failed_recving), which it honours for asynchronous loads only.
        self.multi_group = len(self.spec.groups) > 1
        if self.multi_group and not self.cfg.load_async:
            raise GeometryError(
                f"{len(self.spec.groups)} KV cache groups with kvtier_load_async false: vLLM takes block-level load "
                "errors for one group only and a failed synchronous load of several groups has no other way back; "
                "use asynchronous loads (the default)")
        # Why nothing is restored ("" when loads are offered): several
        # groups on a vLLM that cannot take their failed load back
        # (kvtier.vllm._base.TAKES_FAILED_RECVING). A hit would be safe only
        # while every load succeeds, so none is offered; stores go on (an
        # instance on a newer vLLM in the same share group can use them).
        self.loads_off = ""
        if self.multi_group and not _base.TAKES_FAILED_RECVING:
            self.loads_off = (f"{len(self.spec.groups)} KV cache groups on a vLLM without per-request load failures "
                              "(get_transfer_results, vLLM >= 0.32): a failed load would run on pages never "
                              "written, its block-level errors take one group only")
            if self.is_scheduler:
                log.warning("kvtier restores nothing for this model: %s; stores go on. Upgrade vLLM to restore",
                            self.loads_off)
        # (window, scheduler block) of each sliding-window group
        self._windows = [(gl.sliding_window, self.resolved.geometry[gi].span)
                         for gi, gl in enumerate(self.layers) if gl.sliding_window]
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0))
        self.stats: dict[str, int] = dict.fromkeys((
            "lookups", "lookup_errors", "lookup_timeouts", "lookups_skipped", "plans_renewed", "restores_cancelled",
            "requests_bypassed", "lookup_tokens", "hit_tokens", "loads", "loaded_tokens", "restores",
            "restore_failures", "load_failed_tokens", "recomputed_bad_bytes_tokens", "load_error_blocks", "load_ms",
            "load_steps", "load_steps_max", "loads_skipped", "stores", "stored_objects", "stored_without_state",
            "store_failures", "stores_skipped", "store_waits_cut", "reregistered", "blocks_in_use", "attaches",
            "detaches", "engine_verify_failures",
        ), 0)
        self._stats_sent: dict[str, int] = {}
        self._cancel_lock = threading.Lock()  # restores_cancelled: counted on two threads
        self._link: Link | None = None
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        # Asynchronous loads handed to the workers and not yet reported
        # (finished_recving) nor seen scheduled; requests reported finished
        # meanwhile, for the next metadata's no_send.
        self._loads_in_flight: set[str] = set()
        # What is left of this scheduler step's wait for lookups in flight
        # (kvtier_lookup_wait_s a step; build_connector_meta ends a step).
        self._wait_left = self.cfg.lookup_wait_s
        self._no_send: list[str] = []
        # worker side
        self._session: kvclient.SyncRankSession | None = None
        self._freed_sub: kvclient.SyncClient | None = None  # the client whose BlocksFreed we subscribed to
        self._incarnation = 0
        self._pools: list[wire.PoolRegistration] = []
        # kvtier_verify_on_engine: each group's pools as uint8 page views of
        # vLLM's tensors (kvtier.vllm._verify), set by register_kv_caches.
        self._engine_pools: list[list[Any]] = []
        self._device_uuid = ""
        self._pending: dict[str, list[_Pending]] = {}
        self._saving: set[str] = set()
        self._finishing: set[str] = set()
        self._loading: dict[str, _Loading] = {}
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()  # several groups: failed loads, per request
        self._step = 0  # engine steps seen: get_finished runs once per step
        # The last loads settled, newest last (for tests and debugging):
        # request, restore, engine steps from start to report, ms, chunks
        # loaded of chunks offered, the problem if any.
        self.recent_loads: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)
        self._freed_lock = threading.Lock()
        self._freed: set[tuple[str, tuple[bytes, ...]]] = set()  # guarded by _freed_lock
        self._rank = wire.Rank(self.instances[self.pp_stage], 0)
        self._host: cuda.HostDevice | None = None
        self._host_mems: list[cuda.HostMem] = []  # kvtier_device=host: the pools, alive as long as vLLM's tensors
        log.info("kvtier connector %s: namespace %s, %d groups, chunk %d tokens, TP %d, DCP %d (interleave %d), "
                 "PP %d (stage %d), loads %s", "scheduler" if self.is_scheduler else "worker",
                 ", ".join(str(r.namespace) for r in self.stages), len(self.spec.groups), self.chunk, self.tp,
                 dcp_size, interleave, pp, self.pp_stage, "asynchronous" if self.cfg.load_async else "synchronous")

    # ---------------------------------------------------------------- seams

    def _pp_rank(self) -> int:
        """This worker's pipeline stage (vLLM's PP group rank)."""
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)

    def _stage_layer_counts(self, vllm_config: Any, pp: int) -> list[int]:
        """The decoder layers of each pipeline stage, as vLLM partitions
        them (VLLM_PP_LAYER_PARTITION or its even split)."""
        if pp == 1:
            return [0]
        from vllm.distributed.utils import get_pp_indices

        total = int(vllm_config.model_config.get_total_num_hidden_layers())
        return [end - start for start, end in (get_pp_indices(total, st, pp) for st in range(pp))]

    def _make_client(self) -> kvclient.SyncClient:
        role = "scheduler" if self.is_scheduler else f"worker{self._rank.tp_rank}"
        return kvclient.SyncClient(self.cfg.connect_options(f"kvtier-vllm-{self._rank.instance}-{role}"))

    # ---------------------------------------------------------------- the link (C11)

    def _start_link(self, name: str, setup: Any, check: Any) -> None:
        cap = self.cfg.attach_backoff_max_s
        self._link = Link(name, self._make_client, setup, check=check, check_every_s=self.cfg.health_check_s,
                          backoff_s=min(0.2, cap), max_backoff_s=cap, on_change=self._on_link_change)
        self._link.start()

    def _wait_at_start(self) -> None:
        """Gives the link kvtier_attach_wait_s to attach before vLLM serves,
        so the first requests of a healthy cluster can hit; vLLM starts
        either way (C11)."""
        if self.cfg.attach_wait_s > 0 and not self.wait_attached(self.cfg.attach_wait_s):
            assert self._link is not None
            log.warning("kvtier %s: not attached within %.1f s (%s); vLLM starts without the cache and the "
                        "connector attaches in the background", self._link.name, self.cfg.attach_wait_s,
                        self._link.why)

    def _client_now(self) -> kvclient.SyncClient | None:
        """The client when kvtier is usable now, else None (a miss)."""
        return None if self._link is None else self._link.client

    def wait_attached(self, timeout_s: float) -> bool:
        """Waits up to timeout_s for the link to be attached (its peer
        answered since NATS last came back); True when it is.
        vLLM never calls this: it is for tools and tests that want a warm
        connector before their first request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._attached_now():
                return True
            time.sleep(0.02)
        return self._attached_now()

    def _attached_now(self) -> bool:
        """Attached, not merely usable: a link that is unhealthy only
        because NATS was down hands out its client as soon as NATS is back,
        before its next health check has seen the peer answer again."""
        return self._link is not None and self._link.state == "attached" and self._client_now() is not None

    def _on_link_change(self, state: str) -> None:
        if self._link is not None:  # runs on the link's thread: two plain stores
            self.stats["attaches"], self.stats["detaches"] = self._link.attaches, self._link.detaches
