"""A per-test time limit without a plugin dependency: a test still
running after KVTIER_TEST_LIMIT_S seconds (default 1200; 0 turns it off)
prints every thread's stack, then its own name, to the terminal and ends
the run with status 2. A hung test otherwise runs into CI's limit, and a
CI log that keeps only its last lines shows nothing of where it waits.
Before it ends the run it kills the process groups that tests registered
with track (daemons started in sessions of their own, which would
otherwise outlive the run and hold their ports and CPUs).
Loaded by conftest.py (pytest_plugins), after cluster.py has imported it
(which is why pytest does not rewrite its asserts: it has none;
PYTEST_DONT_REWRITE)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Generator
from typing import Any

import pytest

_groups: set[int] = set()
_groups_lock = threading.Lock()


def track(pgid: int) -> None:
    """Registers the process group pgid (a child started with
    start_new_session=True: its pid) to be killed if the watchdog fires."""
    with _groups_lock:
        _groups.add(pgid)


def untrack(pgid: int) -> None:
    """Forgets pgid (its process was stopped by the test)."""
    with _groups_lock:
        _groups.discard(pgid)


def kill_tracked() -> list[int]:
    """SIGKILLs every tracked process group; returns the groups that were
    still there."""
    with _groups_lock:
        groups = sorted(_groups)
        _groups.clear()
    killed = []
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
            killed.append(g)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def limit_s() -> float:
    return float(os.environ.get("KVTIER_TEST_LIMIT_S", "1200"))


def stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"\n--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "".join(out)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    limit = limit_s()
    if limit <= 0:
        return (yield)

    def fire() -> None:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
        tw = item.config.get_terminal_writer()
        tw.write(stacks())
        tw.write(f"\n{item.nodeid}: still running after {limit:g} s: stuck (every thread's stack above); "
                 "ending the run (KVTIER_TEST_LIMIT_S)\n")
        killed = kill_tracked()
        if killed:
            tw.write(f"killed the process groups the tests started: {killed}\n")
        tw.flush()
        os._exit(2)

    timer = threading.Timer(limit, fire)
    timer.name = "kvtier-test-watchdog"
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()
