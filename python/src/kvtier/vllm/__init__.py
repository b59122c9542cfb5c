"""kvtier's vLLM KV connector: ``kv_connector_module_path="kvtier.vllm"``,
``kv_connector="KvtierConnector"``. Importing this module imports vLLM's
connector base class when vLLM is installed (and a stand-in otherwise)."""

from kvtier.vllm.connector import HAVE_VLLM, KvtierConnector, KvtierConnectorMetadata, LoadSpec, SaveSpec
from kvtier.vllm.spec import spec_from_vllm

__all__ = ["HAVE_VLLM", "KvtierConnector", "KvtierConnectorMetadata", "LoadSpec", "SaveSpec", "spec_from_vllm"]
