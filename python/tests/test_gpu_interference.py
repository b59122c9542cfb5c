"""python/examples/gpu_interference.py's traffic handling, off-GPU: a
traffic command that exits before or during the measurement is an error
that says so (at stop 50 on the H100 the script died of its own cleanup
instead, a ProcessLookupError, when the traffic had failed)."""

from __future__ import annotations

import importlib.util
import pathlib
import time

import pytest

from cluster import REPO

pytest.importorskip("torch")
pytestmark = pytest.mark.vllm  # the venv with torch (make test-vllm)


def _load():
    path = REPO / "python" / "examples" / "gpu_interference.py"
    spec = importlib.util.spec_from_file_location("gpu_interference", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_traffic_that_exits_early_is_an_error(tmp_path: pathlib.Path) -> None:
    gi = _load()
    with pytest.raises(RuntimeError, match=r"exited early \(rc 3\)"):
        gi.with_traffic("exit 3", None, 0.3, 1, str(tmp_path / "t.log"))


def test_traffic_that_exits_during_the_measurement_is_an_error(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    gi = _load()
    monkeypatch.setattr(gi, "measure", lambda step, seconds: time.sleep(1.5) or [1.0])
    with pytest.raises(RuntimeError, match=r"exited during the measurement \(rc 4\)"):
        gi.with_traffic("sleep 0.5; exit 4", None, 0.1, 1, str(tmp_path / "t.log"))
    # Traffic that outlives the measurement is stopped and its steps kept.
    monkeypatch.setattr(gi, "measure", lambda step, seconds: [2.0])
    t0 = time.monotonic()
    steps, _ = gi.with_traffic("sleep 60", None, 0.1, 1, str(tmp_path / "t2.log"))
    assert steps == [2.0] and time.monotonic() - t0 < 10
