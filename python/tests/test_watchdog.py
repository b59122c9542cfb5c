"""The per-test time limit (tests/watchdog.py) ends a hung run."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def run_pytest(test_file: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """pytest on test_file alone, with the watchdog and a 2-second limit."""
    env = dict(os.environ, KVTIER_TEST_LIMIT_S="2", PYTHONPATH=str(HERE))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "watchdog", "-p", "no:cacheprovider", str(test_file)]
    return subprocess.run(argv, cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=60)


def test_a_hung_test_ends_the_run_with_its_stack(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_hangs.py").write_text(
        "import threading\n\n\n"
        "def parked_forever():\n"
        "    threading.Event().wait()\n\n\n"
        "def test_hangs():\n"
        "    parked_forever()\n")
    p = run_pytest(tmp_path / "test_hangs.py")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    tail = out[out.rfind("--- thread MainThread"):]
    assert "parked_forever" in tail and "test_hangs.py::test_hangs: still running after 2 s: stuck" in tail, out


def test_a_quick_test_is_not_ended(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    assert True\n")
    p = run_pytest(tmp_path / "test_quick.py")
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr


def test_a_hung_test_s_daemons_are_killed_with_the_run(tmp_path: pathlib.Path) -> None:
    """A daemon a test started in a session of its own and registered with
    watchdog.track (as cluster.Proc does) does not outlive the ended run."""
    pidfile = tmp_path / "daemon.pid"
    (tmp_path / "test_hangs.py").write_text(
        "import subprocess, threading\n"
        "import watchdog\n\n\n"
        "def test_hangs():\n"
        "    p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "    watchdog.track(p.pid)\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "    threading.Event().wait()\n")
    p = run_pytest(tmp_path / "test_hangs.py")
    out = p.stdout + p.stderr
    pid = int(pidfile.read_text())
    try:
        check_killed(p, out, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)  # not left behind by a failed check


def check_killed(p: subprocess.CompletedProcess[str], out: str, pid: int) -> None:
    assert p.returncode == 2, out
    assert f"killed the process groups the tests started: [{pid}]" in out, out
    gone = False
    for _ in range(100):  # the kill is sent before the run ends; its reaping by init may lag
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone = True
            break
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except FileNotFoundError:  # reaped between the two looks
            state = "gone"
        if state in ("Z", "gone"):  # Z: a zombie, dead, not yet reaped
            gone = True
            break
        time.sleep(0.05)
    assert gone, f"the hung test's daemon {pid} outlived the run"
