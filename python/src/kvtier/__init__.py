"""kvtier: the Python client of kvtier, a KV-cache tiering system.

Modules mirror the Go packages: :mod:`kvtier.dcp` (geometry and identity),
:mod:`kvtier.wire` (messages and subjects), :mod:`kvtier.cuda` (IPC handles
and the host backend), :mod:`kvtier.client` (NATS client, asyncio and
sync) and :mod:`kvtier.vllm` (a vLLM KV connector). Importing the package
starts nothing and imports neither NATS, torch nor vLLM: the names below
are loaded on first use.

    from kvtier import ConnectOptions, SyncClient
    with SyncClient(ConnectOptions(servers=["nats://127.0.0.1:4222"], instance="engine0",
                                   creds_dir="/etc/kvtier/creds")) as c:
        reply = c.lookup(namespace, chunks)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    **{n: "kvtier.client" for n in ("BlockTable", "Client", "ConnectOptions", "RankSession", "RestoreOutcome",
                                    "SyncClient", "SyncRankSession", "restore", "restore_outcome")},
    **{n: "kvtier.errors" for n in ("KvtierError", "MalformedError", "GeometryError", "HandleError", "NotConnected",
                                    "RequestTimeout", "WireError", "Unavailable", "Unauthorized", "UnknownNamespace",
                                    "UnknownSession", "StaleSession")},
    **{n: "kvtier.dcp" for n in ("ChunkHash", "Group", "Key", "Layout", "Namespace", "Spec")},
    **{n: "kvtier.wire" for n in ("Rank", "RestorePlan", "RestoreVerdict", "RetrieveItem", "ChunkBlocks")},
}

__all__ = [
    "BlockTable",
    "ChunkBlocks",
    "ChunkHash",
    "Client",
    "ConnectOptions",
    "GeometryError",
    "Group",
    "HandleError",
    "Key",
    "KvtierError",
    "Layout",
    "MalformedError",
    "Namespace",
    "NotConnected",
    "Rank",
    "RankSession",
    "RequestTimeout",
    "RestoreOutcome",
    "RestorePlan",
    "RestoreVerdict",
    "RetrieveItem",
    "Spec",
    "StaleSession",
    "SyncClient",
    "SyncRankSession",
    "Unauthorized",
    "Unavailable",
    "UnknownNamespace",
    "UnknownSession",
    "WireError",
    "restore",
    "restore_outcome",
]

if TYPE_CHECKING:  # the names for type checkers; at run time __getattr__ loads them
    from kvtier.client import (
        BlockTable,
        Client,
        ConnectOptions,
        RankSession,
        RestoreOutcome,
        SyncClient,
        SyncRankSession,
        restore,
        restore_outcome,
    )
    from kvtier.dcp import ChunkHash, Group, Key, Layout, Namespace, Spec
    from kvtier.errors import (
        GeometryError,
        HandleError,
        KvtierError,
        MalformedError,
        NotConnected,
        RequestTimeout,
        StaleSession,
        Unauthorized,
        Unavailable,
        UnknownNamespace,
        UnknownSession,
        WireError,
    )
    from kvtier.wire import ChunkBlocks, Rank, RestorePlan, RestoreVerdict, RetrieveItem


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
