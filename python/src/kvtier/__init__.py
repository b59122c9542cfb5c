"""kvtier: the Python client of kvtier, a KV-cache tiering system.

Modules mirror the Go packages: :mod:`kvtier.dcp` (geometry and identity),
:mod:`kvtier.wire` (messages and subjects), :mod:`kvtier.cuda` (IPC handles
and the host backend), :mod:`kvtier.client` (NATS client, asyncio and
sync) and :mod:`kvtier.vllm` (a vLLM KV connector). Importing the package
starts nothing and imports neither NATS, torch nor vLLM.
"""

__version__ = "0.1.0"
