"""vLLM's KV connector base classes (KVConnectorBase_V1 and the types its
methods take), or stand-ins with the same constructor when vLLM is not
installed, so that the connector's tests run without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:  # the real base class when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    HAVE_VLLM = True
except ModuleNotFoundError as e:  # a stand-in with the same constructor, for tests without vLLM
    # Only vLLM's absence selects the stand-ins: a vLLM that is installed
    # but lacks one of these names must fail here, not run the connector on
    # a stand-in base class its model runner does not expect.
    if not (e.name or "").startswith("vllm"):
        raise
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

    class SupportsHMA:  # type: ignore[no-redef]
        pass


# KVConnectorTransferResults (get_transfer_results' answer) came with vLLM
# 0.32; vLLM 0.26 has the base class without it and never calls
# get_transfer_results. Before, the name was imported together with the base
# class, so on vLLM 0.26 the whole import failed and the connector ran on
# the stand-in base, which lacks set_host_xfer_buffer_ops: the V2 model
# runner (vLLM 0.26's default for Llama on a GPU) refused to start.
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    _TRANSFER_RESULTS = True
except ImportError:
    _TRANSFER_RESULTS = False

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

# Whether vLLM takes a failed load per request (get_transfer_results'
# failed_recving, vLLM >= 0.32). vLLM 0.26 does not: it reads only
# get_finished, where a failed load looks like a finished one, and its
# block-level channel (get_block_ids_with_load_errors) takes one KV cache
# group only (Scheduler._update_requests_with_invalid_blocks unpacks one
# group's block ids). So on vLLM 0.26 a failed load of a model with several
# groups has no way back: the H200 run of 2026-12-04 saw a hybrid Gemma-2
# generate other tokens than vLLM alone after one. Without vLLM (the tests'
# stand-ins) the fakes behave as vLLM 0.32.
TAKES_FAILED_RECVING = _TRANSFER_RESULTS or not HAVE_VLLM

__all__ = ["HAVE_VLLM", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorTransferResults",
           "SupportsHMA", "TAKES_FAILED_RECVING"]
