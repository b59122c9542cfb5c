"""The connector's link to kvtier, made and kept off vLLM's path (C11).

vLLM must start and serve whether or not kvtier is up. :class:`Link` owns
one :class:`kvtier.client.SyncClient` and the registration that goes with
it (the scheduler's spec, a worker's pools), makes both on a thread of its
own and makes them again when they are lost, with jittered backoff. vLLM's
threads only read :attr:`Link.client`: a client while the link is up,
``None`` while it is not, so a request that would need kvtier is a miss
(recompute) at once instead of a wait.

States, logged once per change and counted:

- ``detached``: no connection or no registration; retried with backoff
  from ``backoff_s`` doubling up to ``max_backoff_s``;
- ``attached``: usable; every ``check_every_s`` the ``check`` callback
  runs (a worker asks its rankd for its incarnation) and may say the
  registration must be made again (``"setup"``) or that the peer is not
  answering (``"down"``, the link is ``unhealthy`` until a check passes);
- ``unhealthy``: connected and registered, but the last check failed:
  requests are not sent, the registration is kept (the same rankd may
  answer again; registering anew would supersede sessions in flight).

A NATS disconnection (the coordinator, which embeds NATS, is down) makes
the link report no client until nats-py has reconnected by itself; then the
client is usable at once (the registration is kept), before the next check
marks the link attached again.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Literal

from kvtier.client import SyncClient

log = logging.getLogger("kvtier.vllm")

State = Literal["detached", "attached", "unhealthy"]
Check = Literal["ok", "setup", "down"]


class Link:
    """One connection to kvtier with its registration, kept in the background."""

    def __init__(self, name: str, connect: Callable[[], SyncClient], setup: Callable[[SyncClient], None], *,
                 check: Callable[[SyncClient], Check] | None = None, check_every_s: float = 1.0,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 on_change: Callable[[State], None] | None = None) -> None:
        if backoff_s <= 0 or max_backoff_s < backoff_s or check_every_s <= 0:
            raise ValueError(f"link {name}: backoff {backoff_s} s, max {max_backoff_s} s, check every "
                             f"{check_every_s} s: want 0 < backoff <= max and check > 0")
        self.name = name
        self._connect, self._setup, self._check = connect, setup, check
        self._check_every, self._backoff, self._max_backoff = check_every_s, backoff_s, max_backoff_s
        self._on_change = on_change
        self._mu = threading.Lock()
        self._client: SyncClient | None = None  # guarded by _mu
        self._state: State = "detached"  # guarded by _mu
        self._why = "not started"  # guarded by _mu
        self._resetup = False  # guarded by _mu: the owner asked for the registration again
        self._nats_down = False  # guarded by _mu: unhealthy only because NATS was disconnected
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # counters, read by the connector's stats
        self.attaches = 0
        self.detaches = 0
        self.attempts = 0

    # ------------------------------------------------------------ read side

    @property
    def state(self) -> State:
        with self._mu:
            return self._state

    @property
    def why(self) -> str:
        """The reason of the last failure (empty once attached)."""
        with self._mu:
            return self._why

    @property
    def client(self) -> SyncClient | None:
        """The client when the link is attached and NATS is connected, else
        None: the caller treats kvtier as absent for this request."""
        with self._mu:
            usable = self._state == "attached" or (self._state == "unhealthy" and self._nats_down)
            c = self._client if usable else None
        if c is None or not c.connected:
            return None
        return c

    @property
    def any_client(self) -> SyncClient | None:
        """The client whatever the state (for shutdown), or None."""
        with self._mu:
            return self._client

    # ------------------------------------------------------------ control

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"kvtier-link-{self.name}", daemon=True)
        self._thread.start()

    def resetup(self, why: str) -> None:
        """Asks for the registration again (a peer said it does not know it)."""
        with self._mu:
            self._resetup = True
        self._set("detached", why)
        self._wake.set()

    def close(self, timeout_s: float) -> SyncClient | None:
        """Stops the thread (waiting at most timeout_s) and hands back the
        client, which the caller closes."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._mu:
            c, self._client, self._state = self._client, None, "detached"
        return c

    # ------------------------------------------------------------ the thread

    def _set(self, state: State, why: str = "") -> None:
        with self._mu:
            old, self._state, self._why = self._state, state, why
        if old == state:
            return
        if state == "attached":
            self.attaches += 1
            log.warning("kvtier %s: attached%s", self.name, f" ({why})" if why else "")
        else:
            if old == "attached":
                self.detaches += 1
            log.warning("kvtier %s: %s, serving without the cache (recompute) and retrying in the background: %s",
                        self.name, state, why)
        if self._on_change is not None:
            self._on_change(state)

    def _sleep(self, s: float) -> bool:
        """Waits s seconds or until woken; True when the link is closing."""
        self._wake.wait(s)
        self._wake.clear()
        return self._stop.is_set()

    def _delay(self, attempt: int) -> float:
        d = min(self._backoff * 2.0 ** min(attempt, 16), self._max_backoff)
        return d / 2 + random.random() * d / 2

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            with self._mu:
                c, resetup = self._client, self._resetup
                self._resetup = False
            if c is None:
                self.attempts += 1
                try:
                    c = self._connect()
                except Exception as e:
                    self._set("detached", f"connect: {e}")
                    if self._sleep(self._delay(attempt)):
                        return
                    attempt += 1
                    continue
                with self._mu:
                    if self._stop.is_set():
                        self._client = None
                    else:
                        self._client = c
                if self._stop.is_set():
                    c.close()
                    return
                resetup = True
            if resetup or self.state == "detached":
                try:
                    self._setup(c)
                except Exception as e:
                    self._set("detached", f"register: {e}")
                    with self._mu:
                        self._resetup = True  # the registration is still to be made
                    if self._sleep(self._delay(attempt)):
                        return
                    attempt += 1
                    continue
                attempt = 0
                self._set("attached", "registered")
            if self._sleep(self._check_every):
                return
            if not c.connected:
                with self._mu:
                    self._nats_down = True
                self._set("unhealthy", "NATS disconnected; reconnecting")
                continue
            with self._mu:
                self._nats_down = False
            if self._check is None:
                if self.state == "unhealthy":
                    self._set("attached", "NATS reconnected")
                continue
            try:
                verdict = self._check(c)
            except Exception as e:
                verdict, why = "down", str(e)
            else:
                why = "check failed" if verdict == "down" else ""
            if verdict == "ok":
                if self.state == "unhealthy":
                    self._set("attached", "answering again")
            elif verdict == "setup":
                with self._mu:
                    self._resetup = True
                self._set("detached", "the peer restarted; registering again")
            else:
                self._set("unhealthy", why)


__all__ = ["Check", "Link", "State"]
