"""Errors of the kvtier client.

Error replies carry a stable code (Go wire.Code*); :func:`from_wire` maps a
code to the matching subclass of :class:`WireError`, so callers catch
``kvtier.errors.Unavailable`` rather than compare strings. An unknown code
still raises a :class:`WireError` with that code.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error this package raises on purpose."""


class MalformedError(KvtierError, ValueError):
    """A message could not be decoded (Go wire.ErrMalformed)."""


class GeometryError(KvtierError, ValueError):
    """A spec, layout or geometry rule failed (Go dcp.ErrGeometry); the
    message names the rule and the numbers."""


class HandleError(KvtierError, ValueError):
    """An IPC handle could not be made or parsed (Go cuda.ErrBadHandle)."""


class CredentialsError(KvtierError, ValueError):
    """A seed, .creds or CA file is unsafe or unreadable (Go
    auth.ErrCredsFile): a symlink, not a regular file, another user's,
    readable by group or others, too large, or not what it should hold.
    The message names the path and the rule."""


class NotConnected(KvtierError):
    """The client is closed, or NATS is unreachable."""


class RequestTimeout(KvtierError, TimeoutError):
    """No reply arrived within the request's timeout."""


class WireError(KvtierError):
    """An error reply: a stable code and the peer's message."""

    code = "unknown"

    def __init__(self, code: str, message: str, subject: str = "", retry_after_ms: int = 0) -> None:
        self.code = code
        self.message = message
        self.subject = subject
        self.retry_after_ms = retry_after_ms
        where = f" (from {subject})" if subject else ""
        super().__init__(f"{code}: {message}{where}")

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed when sent again (Go
        wire.Error.Retryable): codes unavailable and internal."""
        return self.code in ("unavailable", "internal")

    def retry_after(self, default: float) -> float:
        """The sender's retry hint in seconds, or default without one."""
        return self.retry_after_ms / 1000 if self.retry_after_ms > 0 else default


class BadRequest(WireError):
    code = "bad_request"


class UnknownNamespace(WireError):
    code = "unknown_namespace"


class Geometry(WireError):
    code = "geometry"


class NotFound(WireError):
    code = "not_found"


class TooLarge(WireError):
    code = "too_large"


class Unavailable(WireError):
    code = "unavailable"


class Internal(WireError):
    code = "internal"


class UnknownSession(WireError):
    """The rankd never issued the session (or restarted since): register again."""

    code = "unknown_session"


class StaleSession(WireError):
    """Another registration of the instance superseded the session, or it was
    released. Only an engine that is (re)starting should register again."""

    code = "stale_session"


class Unauthorized(WireError):
    code = "unauthorized"


_BY_CODE: dict[str, type[WireError]] = {
    c.code: c for c in (BadRequest, UnknownNamespace, Geometry, NotFound, TooLarge, Unavailable, Internal,
                        UnknownSession, StaleSession, Unauthorized)
}


def from_wire(code: str, message: str, subject: str = "", retry_after_ms: int = 0) -> WireError:
    """Returns the WireError subclass instance for an error reply."""
    return _BY_CODE.get(code, WireError)(code, message, subject, retry_after_ms)
