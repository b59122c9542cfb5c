"""A kvtier cluster of real processes for the integration tests: the Go
binaries built from this repository, a coordinator with its embedded NATS
and TP rankds of instance "engine0" on the host backend, secure as in
production: `coordinator init` makes the credentials (nkeys, users, gossip
key, a TLS CA for 127.0.0.1) and every daemon runs with --creds-dir; the
tests connect as engine-engine0 (connect_options)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier import client

REPO = pathlib.Path(__file__).resolve().parents[2]
HOST_UUID = "HOST-pytest0000000001"
INSTANCE = "engine0"
# The rankds' device: "host" (the host backend, vLLM's CPU build) unless
# KVTIER_TEST_DEVICE names a GPU ("cuda:0"), where the same tests run
# against vLLM's GPU build through CUDA IPC (docs/vllm.md).
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "host")
T = TypeVar("T")


def build_binaries(out: pathlib.Path) -> pathlib.Path:
    """Builds the daemons into out, or uses $KVTIER_BIN_DIR when it is set
    (binaries built beforehand, e.g. from another checkout)."""
    given = os.environ.get("KVTIER_BIN_DIR")
    if given:
        d = pathlib.Path(given)
        for name in ("coordinator", "rankd"):
            if not (d / name).is_file():
                raise RuntimeError(f"KVTIER_BIN_DIR {d} has no {name}")
        return d
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        raise RuntimeError("the integration tests need Go to build cmd/coordinator and cmd/rankd")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["nice", go, "build", "-o", str(out) + "/", "./cmd/coordinator", "./cmd/rankd"],
                   cwd=REPO, check=True, timeout=600)
    return out


def free_port() -> int:
    # Below the ephemeral range, so an outgoing connection cannot take it
    # between here and the daemon's bind.
    for _ in range(200):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % 12000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def eventually(what: str, f: Callable[[], T], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return f()
        except Exception as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s: {last}")


class Proc:
    def __init__(self, name: str, args: list[str], log: pathlib.Path) -> None:
        self.name, self.log = name, log
        self._f = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.p = subprocess.Popen(args, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.p.send_signal(sig)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self._f.close()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def call_failed(request: Any) -> bool:
    """Whether the test that used a fixture failed (conftest keeps each
    phase's report on the item), for the fixture's teardown: the
    daemons' logs are printed then."""
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


class Cluster:
    def __init__(self, bin_dir: pathlib.Path, root: pathlib.Path, tp: int) -> None:
        self.bin, self.root, self.tp = bin_dir, root, tp
        self.shm, self.l2, self.logs, self.index = (root / "shm", root / "l2", root / "logs", root / "index")
        for d in (self.shm, self.l2, self.logs, self.index):
            # Private: the host backend and the L2 tier refuse directories
            # that grant anything to group or others (C9).
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            d.chmod(0o700)
        self.nats_port = free_port()
        self.gossip = f"127.0.0.1:{free_port()}"
        self.rank_addr = [f"127.0.0.1:{free_port()}" for _ in range(tp)]
        self.coord: Proc | None = None
        self.ranks: list[Proc | None] = [None] * tp
        self.creds = root / "creds"
        subprocess.run([str(self.bin / "coordinator"), "init", "--dir", str(self.creds), "--instance", INSTANCE,
                        "--tp-size", str(tp), "--tls-host", "127.0.0.1"], check=True, timeout=60,
                       stdout=subprocess.DEVNULL)

    def connect_options(self, **kw: Any) -> client.ConnectOptions:
        """How the engine of instance engine0 connects: its seed, its
        inbox prefix and the cluster CA, all from the creds dir."""
        kw.setdefault("name", "pytest-engine")
        return client.ConnectOptions(servers=[self.nats_url], instance=INSTANCE, creds_dir=str(self.creds), **kw)

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def start_coordinator(self) -> None:
        self.coord = Proc("coordinator", [str(self.bin / "coordinator"), "serve", "--data-dir", str(self.index),
                                          "--nats-host", "127.0.0.1", "--nats-port", str(self.nats_port),
                                          "--bind", self.gossip, "--http", "127.0.0.1:0", "--log-level", "info",
                                          "--creds-dir", str(self.creds)],
                          self.logs / "coordinator.log")

        def up() -> None:
            assert self.coord is not None
            if not self.coord.alive():
                raise AssertionError(f"coordinator exited:\n{self.coord.tail()}")
            socket.create_connection(("127.0.0.1", self.nats_port), timeout=1).close()

        eventually("coordinator NATS listens", up)

    def start_rank(self, r: int) -> None:
        self.ranks[r] = Proc(f"rankd{r}", [
            str(self.bin / "rankd"), "--instance", INSTANCE, "--tp-rank", str(r), "--tp-size", str(self.tp),
            *self._device_args(), "--l1-bytes", "64MiB",
            "--l2-dir", str(self.l2), "--l2-free-floor", "0", "--join", self.gossip, "--bind", self.rank_addr[r],
            "--http", "127.0.0.1:0", "--log-level", "info", "--creds-dir", str(self.creds)],
            self.logs / f"rankd{r}.log")

    def _device_args(self) -> list[str]:
        if DEVICE == "host":
            return ["--device", "host", "--host-dir", str(self.shm), "--host-uuid", HOST_UUID]
        return ["--device", DEVICE]

    def start_all(self) -> None:
        self.start_coordinator()
        for r in range(self.tp):
            self.start_rank(r)

    def stop_all(self) -> None:
        for p in self.ranks:
            if p is not None:
                p.stop()
        if self.coord is not None:
            self.coord.stop()

    def logs_tail(self) -> str:
        out = []
        for p in [self.coord, *self.ranks]:
            if p is not None:
                out.append(f"--- {p.name}\n{p.tail()}")
        return "\n".join(out)
