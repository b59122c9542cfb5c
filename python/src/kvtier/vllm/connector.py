"""KvtierConnector: vLLM's KVConnectorBase_V1 on kvtier.

Load it with ``kv_transfer_config={"kv_connector": "KvtierConnector",
"kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvtier_nats":
"nats://...", "kvtier_instance": "engine0", "kvtier_creds_dir": "/etc/kvtier/creds"}}``. The connector connects as
engine-<instance> with that directory's seed (and ca.pem, if present);
``kvtier_nkey_seed_file`` / ``kvtier_tls_ca_file`` name them one by one.
Without credentials it refuses to start (``kvtier_insecure`` only for an
``--insecure`` coordinator). Every key: docs/vllm.md.

A cache outage never takes vLLM down (C11). The connection and the
registrations are made by a background link (kvtier.vllm.attach) that
retries with backoff; while it is not attached every lookup is a miss and
every store is skipped at once. Nothing on vLLM's path waits on the network
for longer than kvtier_lookup_wait_s per scheduler call; a lookup, restore
or store that times out or fails is a recompute, never "not yet" forever.

Scheduler side: ``get_num_new_matched_tokens`` sends the lookup and, on a
hit, begins the restore at the coordinator (answering "not yet", None,
while they are in flight, for at most twice kvtier_lookup_timeout_s); the
plan is kept per request, so repeated calls agree and building the step's
metadata sends nothing; ``update_state_after_alloc`` records what to load
into which blocks; ``build_connector_meta`` hands each load its plan and
lists the chunks to store that this step completes; ``request_finished``
keeps a request's blocks while stores may still read them.

Worker side: ``register_kv_caches`` checks every layer's pool (raw CUDA IPC
handle plus offset) and the link registers them with the worker's rankd,
again whenever the rankd restarts; ``start_load_kv`` sends this rank's part
of every restore and returns (loads are asynchronous: ``get_finished``
reports a request once its verdict is in, bounded by the restore deadline);
only a complete verdict counts, and every block of a chunk that is not
confirmed goes to ``get_block_ids_with_load_errors`` so vLLM recomputes it;
``wait_for_save`` records one interprocess event per store (C1) after the
forward and sends the stores (with a sliding-window or Mamba group it waits
for their answers, until their gather limit: kvtier_store_wait_s +
kvtier_store_grace_s); ``get_finished`` reports a request once all its
stores have answered. ``get_kv_connector_stats`` feeds vLLM's stats
and /metrics (kvtier.vllm.stats).

The spec comes from vLLM's kv_cache_config (see kvtier.vllm.spec) and
fails closed on layouts it does not understand.

The class is put together from parts: kvtier.vllm._core (the state both
sides share and the link), kvtier.vllm._scheduler (the scheduler side),
kvtier.vllm._worker (the worker side, with kvtier.vllm._verify for
kvtier_verify_on_engine), kvtier.vllm._state (the step's
metadata and the per-request bookkeeping) and kvtier.vllm._base (vLLM's
base classes, or stand-ins without vLLM). This module keeps the settings
(Config), construction, the stats hooks and shutdown, and exports the
names that vLLM and the tests import from it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtier import client as kvclient
from kvtier import cuda, wire
from kvtier.vllm._base import HAVE_VLLM, SupportsHMA
from kvtier.vllm._base import KVConnectorBase_V1 as KVConnectorBase_V1
from kvtier.vllm._base import KVConnectorMetadata as KVConnectorMetadata
from kvtier.vllm._base import KVConnectorRole as KVConnectorRole
from kvtier.vllm._base import KVConnectorTransferResults as KVConnectorTransferResults
from kvtier.vllm._scheduler import _SchedulerSide
from kvtier.vllm._state import NULL_BLOCK as NULL_BLOCK
from kvtier.vllm._state import KvtierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.vllm._worker import _WorkerSide
from kvtier.vllm.attach import Link
from kvtier.vllm.stats import KvtierPromMetrics, KvtierStats
from kvtier.vllm.stats import delta as stats_delta

log = logging.getLogger("kvtier.vllm")


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
    # How long a save may hold vLLM's blocks waiting for rankd L1 room: the
    # store's deadline (Kvtier-Deadline), after which its objects not yet
    # copied fail and it answers, so vLLM frees the blocks (C11, issue 24).
    store_wait_s: float
    # How long past store_wait_s vLLM's step waits for a copy already begun
    # when it cannot keep the blocks (sliding-window and Mamba groups): at
    # the store's deadline plus this grace the step goes on, and the rankd
    # stores nothing whose copy ends later (Kvtier-Gather-Limit, C11).
    store_grace_s: float
    lookup_wait_s: float
    lookup_timeout_s: float
    restore_deadline_ms: int
    load_async: bool
    health_check_s: float
    attach_backoff_max_s: float
    attach_wait_s: float
    shutdown_timeout_s: float
    device: str  # "cuda" or "host"
    host_dir: str  # private (0700), default cuda.default_host_dir()
    host_uuid: str | None
    creds_dir: str | None  # from `coordinator init`: engine-<instance>.nk, ca.pem
    nkey_seed_file: str | None
    tls_ca_file: str | None
    inbox_prefix: str | None
    insecure: bool  # DEVELOPMENT ONLY: no credentials (an --insecure coordinator)
    pool_layout: str  # block_major | kv_split (kvtier.vllm.spec)
    verify_on_engine: bool = False  # sum the restored pages on the engine's device (kvtier.vllm._verify)
    # GB/s (10^9 B/s) an asynchronous load's copies are bounded to when it
    # starts while vLLM runs other requests (their steps slow less; 0, the
    # default: full speed; docs/vllm.md).
    load_pace_gbps: float = 0.0

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
                store_wait_s=float(extra.get("kvtier_store_wait_s", 2.0)),
                store_grace_s=float(extra.get("kvtier_store_grace_s", 0.5)),
                lookup_wait_s=float(extra.get("kvtier_lookup_wait_s", 0.005)),
                lookup_timeout_s=float(extra.get("kvtier_lookup_timeout_s", 2.0)),
                restore_deadline_ms=int(extra.get("kvtier_restore_deadline_ms", 10000)),
                load_async=_flag(extra.get("kvtier_load_async", True)),
                health_check_s=float(extra.get("kvtier_health_check_s", 1.0)),
                attach_backoff_max_s=float(extra.get("kvtier_attach_backoff_max_s", 5.0)),
                attach_wait_s=float(extra.get("kvtier_attach_wait_s", 5.0)),
                shutdown_timeout_s=float(extra.get("kvtier_shutdown_timeout_s", 5.0)),
                device=extra.get("kvtier_device", "cuda"),
                host_dir=extra.get("kvtier_host_dir") or cuda.default_host_dir(),
                host_uuid=extra.get("kvtier_host_uuid"), creds_dir=extra.get("kvtier_creds_dir"),
                nkey_seed_file=extra.get("kvtier_nkey_seed_file"),
                tls_ca_file=extra.get("kvtier_tls_ca_file"), inbox_prefix=extra.get("kvtier_inbox_prefix"),
                insecure=_flag(extra.get("kvtier_insecure", False)),
                pool_layout=extra.get("kvtier_pool_layout", "block_major"),
                verify_on_engine=_flag(extra.get("kvtier_verify_on_engine", False)),
                load_pace_gbps=float(extra.get("kvtier_load_pace_gbps", 0.0)))
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
        if policy is not None and policy != "recompute":
            # vLLM's default "fail" ends a request with an error when a load
            # fails; kvtier is a cache: a chunk it cannot restore must be
            # recomputed (get_block_ids_with_load_errors), never fatal.
            raise ValueError(f'kv_transfer_config kv_load_failure_policy "{policy}": the kvtier connector needs '
                             '"recompute" (a chunk kvtier cannot restore is recomputed, not an error for the request)')
        wire.valid_instance(c.instance)
        for key, v in (("kvtier_timeout_s", c.timeout_s), ("kvtier_store_wait_s", c.store_wait_s),
                       ("kvtier_lookup_timeout_s", c.lookup_timeout_s),
                       ("kvtier_health_check_s", c.health_check_s),
                       ("kvtier_attach_backoff_max_s", c.attach_backoff_max_s),
                       ("kvtier_shutdown_timeout_s", c.shutdown_timeout_s)):
            if not v > 0:
                raise ValueError(f"kv_connector_extra_config {key} {v}: want > 0 seconds")
        for key, v in (("kvtier_attach_wait_s", c.attach_wait_s), ("kvtier_store_grace_s", c.store_grace_s)):
            if not v >= 0:
                raise ValueError(f"kv_connector_extra_config {key} {v}: want >= 0 seconds")
        if c.lookup_wait_s < 0 or c.restore_deadline_ms <= 0:
            raise ValueError(f"kv_connector_extra_config kvtier_lookup_wait_s {c.lookup_wait_s} (want >= 0), "
                             f"kvtier_restore_deadline_ms {c.restore_deadline_ms} (want > 0)")
        if not (c.load_pace_gbps == 0 or (0 < c.load_pace_gbps < 1e6 and c.load_pace() >= wire.MIN_PACE)):  # NaN too
            raise ValueError(f"kv_connector_extra_config kvtier_load_pace_gbps {c.load_pace_gbps}: want 0 (full speed) "
                             f"or at least {wire.MIN_PACE / 1e9:.3f} GB/s")
        if c.chunk_tokens is not None and c.chunk_tokens <= 0:
            raise ValueError(f"kv_connector_extra_config kvtier_chunk_tokens {c.chunk_tokens}: want > 0")
        if c.device not in ("cuda", "host"):
            raise ValueError(f"kvtier_device {c.device!r}: want cuda or host")
        try:
            c.connect_options("kvtier-vllm").validate()
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: {e} (keys kvtier_creds_dir, kvtier_nkey_seed_file, "
                             f"kvtier_tls_ca_file; kvtier_insecure only for an --insecure coordinator)") from None
        return c

    def load_pace(self) -> int:
        """kvtier_load_pace_gbps in bytes per second, as the Kvtier-Pace
        header carries it (0: off)."""
        return int(self.load_pace_gbps * 1e9)

    def connect_options(self, name: str) -> kvclient.ConnectOptions:
        # The first connection is tried for at most lookup_timeout_s; the
        # link tries again in the background (C11).
        return kvclient.ConnectOptions(servers=self.nats, name=name, prefix=self.prefix, timeout=self.timeout_s,
                                       connect_timeout=self.lookup_timeout_s,
                                       instance=self.instance, creds_dir=self.creds_dir,
                                       nkey_seed_file=self.nkey_seed_file, tls_ca_file=self.tls_ca_file,
                                       inbox_prefix=self.inbox_prefix, insecure=self.insecure)

    def host_device(self) -> cuda.HostDevice:
        """The host backend device of kvtier_device=host: host_dir (created
        0700 when it is the default) must be private, as rankd requires."""
        return cuda.HostDevice(self.host_dir, self.host_uuid)


def _flag(v: Any) -> bool:
    """A boolean key: JSON true/false, or the strings 1/true/yes/on and 0/false/no/off."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"kv_connector_extra_config: {v!r} is not a boolean")


class KvtierConnector(_SchedulerSide, _WorkerSide, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector storing and restoring through kvtier. It declares
    vLLM's SupportsHMA: every KV cache group is stored and restored
    (kvtier.vllm.spec says what is refused)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._init_state(Config.of(vllm_config), vllm_config, role, kv_cache_config)
        if self.is_scheduler:
            self._start_link("scheduler", self._setup_scheduler, None)
            self._wait_at_start()

    # ---------------------------------------------------------------- stats

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """What the worker counters did since the last call (vLLM sums the
        workers' and exports them: kvtier.vllm.stats)."""
        return stats_delta(self.stats, self._stats_sent)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats | None:
        return KvtierStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Waits for stores in flight and releases the pools, all within
        kvtier_shutdown_timeout_s: a dead daemon never holds vLLM's exit."""
        link, self._link = self._link, None
        try:
            self._shutdown_link(link)
        finally:
            self._unlink_host_files()

    def _shutdown_link(self, link: Link | None) -> None:
        if link is None:
            return
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        c = link.close(min(1.0, self.cfg.shutdown_timeout_s))
        if c is None:
            return
        try:
            if self._session is not None and c.connected:
                futs = [p.fut for pend in self._pending.values() for p in pend]
                _, left = concurrent.futures.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
                if left:
                    log.warning("kvtier shutdown: %d stores still in flight after %.1f s; not waiting",
                                len(left), self.cfg.shutdown_timeout_s)
                rest = deadline - time.monotonic()
                if rest > 0:
                    try:
                        c.run(self._session.aio.release(), rest)
                    except Exception as e:
                        log.warning("kvtier release at shutdown: %s", e)
        finally:
            self._close_client(c, max(0.1, deadline - time.monotonic()))

    @staticmethod
    def _close_client(c: kvclient.SyncClient, timeout_s: float) -> None:
        t = threading.Thread(target=c.close, name="kvtier-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("kvtier shutdown: the client did not close within %.1f s; leaving it", timeout_s)


__all__ = ["HAVE_VLLM", "KvtierConnector", "KvtierConnectorMetadata", "LoadSpec", "SaveSpec"]
