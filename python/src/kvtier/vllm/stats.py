"""The connector's counters in vLLM's own stats and Prometheus metrics.

Workers hand vLLM a :class:`KvtierStats` each step (only what changed since
the last one, ``get_kv_connector_stats``); vLLM sums them across workers and
steps, logs them with its throughput line and feeds :class:`KvtierPromMetrics`,
which exports every counter as ``kvtier:<name>_total`` on vLLM's /metrics.
The tokens vLLM asked the cache about and the tokens it was offered are
vLLM's own ``vllm:external_prefix_cache_queries`` / ``_hits`` (taken from
``get_num_new_matched_tokens``), so they are not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # stand-ins with the same shape, for tests without vLLM

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            self._counter_cls = next(v for k, v in metric_types.items() if getattr(k, "__name__", "") == "Counter")
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


# The counters exported (the workers', and three of the scheduler's), with what each counts. Every one is a sum
# over workers: with TP > 1 a restore of n tokens counts n on every rank.
COUNTERS: dict[str, str] = {
    "loads": "restores the worker took part in",
    "loaded_tokens": "tokens restored from kvtier and confirmed on every rank (a COMPLETE verdict)",
    "load_failed_tokens": "tokens vLLM was offered but recomputed because the restore did not confirm them",
    "recomputed_bad_bytes_tokens": "of those, tokens recomputed because a rank's bytes did not match the sum "
                                   "recorded at store time (checksum mismatch)",
    "load_ms": "milliseconds from a load's start to its verdict, summed",
    "loads_skipped": "restores failed at once because kvtier was not attached",
    "stores": "store requests sent",
    "stored_objects": "objects stored (committed) by the rankd",
    "stored_without_state": "chunks of a Mamba / linear-attention hybrid sent to store without their state "
                            "(vLLM kept none at the chunk's end): a restore may span them, never end on them",
    "store_failures": "store requests that failed or reported failed objects",
    "stores_skipped": "stores not sent because kvtier was not attached",
    "store_waits_cut": "stores of sliding-window or Mamba groups whose answer vLLM's step stopped waiting for at "
                       "the gather limit (kvtier_store_wait_s + kvtier_store_grace_s); the rankd stores nothing "
                       "copied after it",
    "engine_verify_failures": "chunks confirmed by the verdict that the worker recomputed because the pages placed "
                              "in its KV tensors did not sum to the coordinator's recorded sum "
                              "(kvtier_verify_on_engine)",
    # The scheduler's (vLLM >= 0.32 adds the scheduler's stats to the workers').
    "plans_renewed": "restores begun again because the request waited for blocks past half of the restore's deadline",
    "restores_cancelled": "restores withdrawn (restore.cancel sent) because their load was never handed to the "
                          "workers: the request finished first, vLLM took fewer chunks, or the lookup was redone",
    "requests_bypassed": "requests neither restored nor stored: a LoRA adapter, multimodal inputs or prompt "
                         "embeddings, which the chunk hashes do not cover",
    "attaches": "times the worker (re)attached to its rankd",
    "detaches": "times the worker lost its rankd and served without the cache",
}


@dataclass
class KvtierStats(KVConnectorStats):  # type: ignore[misc]
    """A delta of the worker counters (COUNTERS); summed by aggregate."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KvtierStats:
        out = dict(self.data)
        for k, v in (getattr(other, "data", None) or {}).items():
            out[k] = out.get(k, 0) + v
        return KvtierStats(out)

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data[k] for k in COUNTERS if self.data.get(k)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def delta(now: dict[str, int], last: dict[str, int]) -> KvtierStats | None:
    """The counters of COUNTERS that moved since last (updated to now), or
    None when none did."""
    d = {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}
    d = {k: v for k, v in d.items() if v}
    for k in COUNTERS:
        last[k] = now.get(k, 0)
    return KvtierStats(d) if d else None


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvtier:<counter>_total per vLLM engine, from the aggregated stats."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            c = self._counter_cls(name=f"kvtier:{name}", documentation=f"kvtier connector: {doc}",
                                  labelnames=labelnames)
            self.counters[name] = {idx: c.labels(*vals) for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, v in transfer_stats_data.items():
            per = self.counters.get(name)
            if per is not None and v > 0 and engine_idx in per:
                per[engine_idx].inc(v)


__all__ = ["COUNTERS", "KvtierPromMetrics", "KvtierStats", "delta"]
