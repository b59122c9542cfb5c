"""Which base class the connector subclasses, by the vLLM that is installed.

vLLM 0.26 (the GPU machine's) has KVConnectorBase_V1 but not
KVConnectorTransferResults (vLLM 0.32). When both were imported in one
statement, the missing name made the whole import fail and the connector
silently ran on the stand-in base, which lacks the methods vLLM's model
runners call (set_host_xfer_buffer_ops: vLLM 0.26's V2 runner refused to
start). Each case runs in a fresh interpreter with a fake ``vllm`` package
first on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

BASE_026 = """
import enum
class SupportsHMA: pass
class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1
class KVConnectorMetadata: pass
class KVConnectorBase_V1:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._role = role
    def set_host_xfer_buffer_ops(self, op):
        self.op = op
"""


def _fake_vllm(root: Path, base: str) -> None:
    d = root / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    d.mkdir(parents=True)
    for p in [root / "vllm", *list(d.parents)[: len(d.relative_to(root).parts) - 1], d]:
        (p / "__init__.py").touch()
    (d / "base.py").write_text(textwrap.dedent(base))


def _run(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(SRC)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_vllm_without_transfer_results_keeps_its_base_class(tmp_path: Path) -> None:
    _fake_vllm(tmp_path, BASE_026)
    r = _run(tmp_path, """
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from kvtier.vllm import HAVE_VLLM, KvtierConnector
        from kvtier.vllm._base import KVConnectorTransferResults
        assert HAVE_VLLM, "HAVE_VLLM is False with vLLM installed"
        assert issubclass(KvtierConnector, base.KVConnectorBase_V1), KvtierConnector.__mro__
        assert hasattr(KvtierConnector, "set_host_xfer_buffer_ops")
        r = KVConnectorTransferResults(finished_recving={"a"})
        assert r.finished_recving == {"a"} and r.failed_recving == set()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_vllm_with_transfer_results_uses_its_own(tmp_path: Path) -> None:
    _fake_vllm(tmp_path, BASE_026 + "\nclass KVConnectorTransferResults:\n    pass\n")
    r = _run(tmp_path, """
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from kvtier.vllm._base import KVConnectorTransferResults
        assert KVConnectorTransferResults is base.KVConnectorTransferResults
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_vllm_missing_the_base_class_fails_loudly(tmp_path: Path) -> None:
    # An installed vLLM without a name the connector needs is an error, not
    # a reason to run on the stand-ins.
    _fake_vllm(tmp_path, BASE_026.replace("class SupportsHMA: pass", ""))
    r = _run(tmp_path, "import kvtier.vllm.connector\n")
    assert r.returncode != 0 and "SupportsHMA" in r.stderr, (r.returncode, r.stderr[-500:])
