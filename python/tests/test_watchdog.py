"""The per-test time limit (tests/watchdog.py) ends a hung run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_a_hung_test_ends_the_run_with_its_stack(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_hangs.py").write_text(
        "import threading\n\n\n"
        "def parked_forever():\n"
        "    threading.Event().wait()\n\n\n"
        "def test_hangs():\n"
        "    parked_forever()\n")
    env = dict(os.environ, KVTIER_TEST_LIMIT_S="2", PYTHONPATH=str(HERE))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "watchdog", "-p", "no:cacheprovider",
                        str(tmp_path / "test_hangs.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    tail = out[out.rfind("--- thread MainThread"):]
    assert "parked_forever" in tail and "test_hangs.py::test_hangs: still running after 2 s: stuck" in tail, out


def test_a_quick_test_is_not_ended(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    assert True\n")
    env = dict(os.environ, KVTIER_TEST_LIMIT_S="2", PYTHONPATH=str(HERE))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "watchdog", "-p", "no:cacheprovider",
                        str(tmp_path / "test_quick.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
