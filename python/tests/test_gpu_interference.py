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


def test_the_measurement_waits_for_the_traffics_loop(tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """At stop 54 on the H100 the defaults' run measured the loop beside the
    bench's setup (its stores and byte comparisons outlasted the fixed warm
    time; 0 restores in the measurement): with ready the measurement starts
    only once the traffic says its loop has begun."""
    gi = _load()
    log = tmp_path / "t.log"
    seen: list[str] = []

    def measure(step: object, seconds: float) -> list[float]:
        seen.append(log.read_text())
        return [1.0]

    monkeypatch.setattr(gi, "measure", measure)
    cmd = "echo setup; sleep 1.5; echo 'gpu-bench: traffic started'; sleep 60"
    steps, _ = gi.with_traffic(cmd, None, 0.1, 1, str(log), r"^gpu-bench: traffic started", 30)
    assert steps == [1.0] and "traffic started" in seen[0]
    # Never begun: an error within the timeout, none when it exits first.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"traffic loop not begun after 1 s"):
        gi.with_traffic("echo setup; sleep 60", None, 0.1, 1, str(log), r"^gpu-bench: traffic started", 1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match=r"exited before its loop began \(rc 5\)"):
        gi.with_traffic("exit 5", None, 0.1, 1, str(log), r"^gpu-bench: traffic started", 30)
