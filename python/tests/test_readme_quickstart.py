"""The README's vLLM quickstart, run as written: the shell blocks marked
``<!-- quickstart -->`` in README.md, in one bash process, in a temporary
directory whose ``bin`` is a fresh build of cmd/coordinator and cmd/rankd,
with this venv (python/.venv-vllm) first on PATH, as after the README's
``. python/.venv-vllm/bin/activate``.

The only change to the text: a port the README names that is taken on this
machine (another test, another agent) is replaced by a free one, and the
test says so. It asserts what the README promises: the second request's
tokens equal the first's, vLLM reports its prompt as cached, the
coordinator counts a hit and a complete restore, vLLM counts external
prefix-cache hits; and the metric lines printed are the ones the README
shows.

Run by `make test-vllm` (minutes: vLLM starts on CPU); deselected in the
plain suite (pytest -m "not vllm")."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import watchdog

from cluster import REPO, build_binaries

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

README = REPO / "README.md"
MARK = "<!-- quickstart -->"
PORTS = (4222, 7946, 7947, 8000, 9470, 9471)


def quickstart_blocks(text: str) -> list[str]:
    """The fenced sh blocks that directly follow a quickstart mark."""
    blocks = re.findall(re.escape(MARK) + r"\n```sh\n(.*?)\n```", text, re.S)
    if len(blocks) != text.count(MARK):
        raise AssertionError(f"{text.count(MARK)} quickstart marks but {len(blocks)} ```sh blocks right after them")
    return blocks


def expected_output(text: str) -> list[str]:
    """The metric lines of the README's example output (the plain fenced
    block that starts with "tokens")."""
    m = re.search(r"\n```\n(tokens .*?)\n```", text, re.S)
    assert m, "README: no example output block starting with 'tokens'"
    return [line for line in m.group(1).splitlines() if not line.startswith("tokens")]


def port_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port(taken: set[int]) -> int:
    for _ in range(500):
        p = 20000 + int.from_bytes(os.urandom(2), "big") % 12000
        if p not in taken and port_free(p):
            return p
    raise RuntimeError("no free port")


def test_unit_quickstart_blocks_are_found() -> None:
    blocks = quickstart_blocks(README.read_text())
    text = "\n".join(blocks)
    assert len(blocks) >= 3 and "--kv-transfer-config" in text and '"kv_load_failure_policy": "recompute"' in text


def test_readme_quickstart_runs_verbatim(tmp_path: pathlib.Path) -> None:
    text = README.read_text()
    script = "\n".join(quickstart_blocks(text))
    moved = {}
    for p in PORTS:
        if not port_free(p):
            moved[p] = free_port(set(PORTS) | set(moved.values()))
            script = re.sub(rf"\b{p}\b", str(moved[p]), script)
    if moved:
        print(f"ports taken on this machine, replaced in the script: {moved}")
    (tmp_path / "bin").symlink_to(build_binaries(tmp_path / "gobin"))  # $KVTIER_BIN_DIR when set
    (tmp_path / "quickstart.sh").write_text("set -euo pipefail\n" + script + "\n")

    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
               VIRTUAL_ENV=str(pathlib.Path(venv_bin).parent))
    shm = pathlib.Path(f"/dev/shm/kvtier-{os.getuid()}")
    shm_before = set(shm.iterdir()) if shm.exists() else set()
    log = tmp_path / "quickstart.out"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        p = subprocess.Popen(["bash", str(tmp_path / "quickstart.sh")], cwd=tmp_path, env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        watchdog.track(p.pid)
        try:
            rc = p.wait(1500)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            took = time.monotonic() - t0
            # the daemons and vLLM were started with & in the script's
            # process group: SIGTERM them, then SIGKILL what is left
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(10 if sig == signal.SIGTERM else 0)
            p.wait()
            watchdog.untrack(p.pid)
            if shm.exists():
                for f in set(shm.iterdir()) - shm_before:
                    f.unlink(missing_ok=True)
    output = log.read_text(errors="replace")
    print(f"quickstart: {took:.0f} s, exit {rc}\n{output[-4000:]}")
    qs = tmp_path / "quickstart"
    if rc != 0:
        for name in ("coordinator.log", "rankd.log", "vllm.log"):
            f = qs / name
            if f.exists():
                print(f"--- {name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
    assert rc == 0, f"the quickstart script exited {rc} after {took:.0f} s"

    r1, r2 = (json.loads((qs / f"reply{i}.json").read_text()) for i in (1, 2))
    t1, t2 = r1["choices"][0]["token_ids"], r2["choices"][0]["token_ids"]
    assert len(t1) == 8 and t1 == t2, (t1, t2)
    c1 = r1["usage"]["prompt_tokens_details"]["cached_tokens"]
    c2 = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (c1 or 0) == 0 and c2 == 256, (c1, c2)

    printed = [line for line in output.splitlines() if line.startswith(("kvtier_coord_", "vllm:", "kvtier:"))]
    assert printed == expected_output(text), "the metric lines differ from the README's example output"
