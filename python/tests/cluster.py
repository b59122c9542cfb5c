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

import watchdog

from kvtier import client

REPO = pathlib.Path(__file__).resolve().parents[2]
HOST_UUID = "HOST-pytest0000000001"
INSTANCE = "engine0"
# The rankds' device: "host" (the host backend, vLLM's CPU build) unless
# KVTIER_TEST_DEVICE names a GPU ("cuda:0"), where the same tests run
# against vLLM's GPU build through CUDA IPC (docs/vllm.md).
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "host")
T = TypeVar("T")


_built: pathlib.Path | None = None  # the daemons this pytest process built, if any


def build_binaries(out: pathlib.Path) -> pathlib.Path:
    """Builds the daemons into out once per pytest process (every later
    call returns that directory), or uses $KVTIER_BIN_DIR when it is set
    (binaries built beforehand, e.g. from another checkout). Not niced: at
    a load of 10 a niced build took 4-5 minutes per test module (a CI run
    of make test-vllm, 2026-12-04)."""
    global _built
    given = os.environ.get("KVTIER_BIN_DIR")
    if given:
        d = pathlib.Path(given)
        for name in ("coordinator", "rankd"):
            if not (d / name).is_file():
                raise RuntimeError(f"KVTIER_BIN_DIR {d} has no {name}")
        return d
    if _built is not None and all((_built / name).is_file() for name in ("coordinator", "rankd")):
        return _built
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        raise RuntimeError("the integration tests need Go to build cmd/coordinator and cmd/rankd")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([go, "build", "-o", str(out) + "/", "./cmd/coordinator", "./cmd/rankd"],
                   cwd=REPO, check=True, timeout=600)
    _built = out
    return out


_handed_out: set[int] = set()


def free_port() -> int:
    # Below the ephemeral range, so an outgoing connection cannot take it
    # between here and the daemon's bind; never one this process handed
    # out before: two picks of one cluster landing on the same free port
    # (a rankd's gossip port equal to the NATS port) failed make test once.
    for _ in range(200):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % 12000
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
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
        watchdog.track(self.p.pid)  # killed if the run is ended for a hung test

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
        watchdog.untrack(self.p.pid)
        self._f.close()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def running(c: Cluster, request: Any):  # type: ignore[no-untyped-def]
    """A fixture's body for cluster c: starts it, yields it, prints the
    daemons' logs when the test failed, stops it."""
    c.start_all()
    try:
        yield c
    finally:
        if call_failed(request):
            print(c.logs_tail())
        c.stop_all()


def call_failed(request: Any) -> bool:
    """Whether the test that used a fixture failed (conftest keeps each
    phase's report on the item), for the fixture's teardown: the
    daemons' logs are printed then."""
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


class Cluster:
    """pp > 1: pipeline stages, each a world of its own: rankds of instance
    engine0-pp<stage> (wire.StageInstance), TP of them per stage, in
    self.ranks stage by stage; the engine identity acts for every stage."""

    def __init__(self, bin_dir: pathlib.Path, root: pathlib.Path, tp: int, pp: int = 1) -> None:
        self.bin, self.root, self.tp, self.pp = bin_dir, root, tp, pp
        self.rank_ids = [(INSTANCE if pp == 1 else f"{INSTANCE}-pp{s}", t) for s in range(pp) for t in range(tp)]
        self.shm, self.l2, self.logs, self.index = (root / "shm", root / "l2", root / "logs", root / "index")
        for d in (self.shm, self.l2, self.logs, self.index):
            # Private: the host backend and the L2 tier refuse directories
            # that grant anything to group or others (C9).
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            d.chmod(0o700)
        self.nats_port = free_port()
        self.gossip = f"127.0.0.1:{free_port()}"
        self.rank_addr = [f"127.0.0.1:{free_port()}" for _ in self.rank_ids]
        self.coord: Proc | None = None
        self.ranks: list[Proc | None] = [None] * len(self.rank_ids)
        self.creds = root / "creds"
        subprocess.run([str(self.bin / "coordinator"), "init", "--dir", str(self.creds), "--instance", INSTANCE,
                        "--tp-size", str(tp), *(["--pp-size", str(pp)] if pp > 1 else []),
                        "--tls-host", "127.0.0.1"], check=True, timeout=60, stdout=subprocess.DEVNULL)

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
        inst, t = self.rank_ids[r]
        self.ranks[r] = Proc(f"rankd{r}", [
            str(self.bin / "rankd"), "--instance", inst, "--tp-rank", str(t), "--tp-size", str(self.tp),
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
        for r in range(len(self.rank_ids)):
            self.start_rank(r)

    def wait_resynced(self) -> None:
        """Waits until the coordinator has resynced every rank once (its
        startup inventory requests, retried until the rankds answer). While
        a rank's inventory streams in, lookups see none of its placements
        (docs/running.md): a test whose lookup and restore run during it
        gets a miss (seen: a restore planned nothing just after a restore
        of the same chunks completed)."""
        n = len(self.rank_ids)
        eventually(f"the coordinator resynced {n} ranks",
                   lambda: self.coord_metric("kvtier_coord_resyncs_total", outcome="ok") >= n
                   or (_ for _ in ()).throw(AssertionError("not yet")))

    def coord_metric(self, name: str, **labels: str) -> float:
        """One sample of the coordinator's /metrics (its HTTP address from
        its log); 0 when the series does not exist yet."""
        import re
        import urllib.request

        assert self.coord is not None
        m = re.search(r'"http":\s*"([^"]+)"', self.coord.log.read_text(errors="replace"))
        assert m, "the coordinator logged no HTTP address"
        with urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10) as r:
            text = r.read().decode()
        want = sorted(f'{k}="{v}"' for k, v in labels.items())
        total = 0.0
        for line in text.splitlines():
            mm = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
            if mm and all(w in (mm.group(1) or "").split(",") for w in want):
                total += float(mm.group(2))
        return total

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
