"""JSON encoding that is byte-identical to Go's encoding/json.

Messages are dataclasses whose fields carry their JSON name and Go's
``omitempty`` / ``omitzero`` flag in the field metadata (see :func:`field`).
Encoding walks the fields in declaration order, which is the order of the Go
struct, so ``encode(msg)`` equals Go's ``json.Marshal`` of the same value:

- ``bytes`` travel as standard base64 with padding (Go ``[]byte``);
- empty lists encode as ``[]``: Python never sends ``null`` for a list, and
  decodes ``null`` as an empty list (Go treats both the same on input);
- map keys are sorted, as Go sorts them;
- ``<``, ``>``, ``&``, U+2028 and U+2029 are escaped as Go escapes them.

Decoding is strict about types (a bool is not an int, an int must fit its
Go width) and lenient about unknown fields, so a newer peer that adds a
field does not break an older client. Every decoding failure raises
:class:`kvtier.errors.MalformedError`, never anything else.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from kvtier.errors import MalformedError

T = TypeVar("T")

_JSON = "kvtier.json"
_OMIT = "kvtier.omit"  # "" | "omitempty" | "omitzero"


def field(name: str, *, omit: str = "", default: Any = dataclasses.MISSING,
          default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its Go JSON name and omit rule."""
    md = {_JSON: name, _OMIT: omit}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


class TextValue:
    """Base of values that travel as JSON strings (Go TextMarshaler)."""

    def to_text(self) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls, s: str) -> Any:
        raise NotImplementedError

    def is_zero(self) -> bool:
        return False


_INT_RANGES: dict[str, tuple[int, int]] = {
    "u8": (0, 0xFF),
    "u16": (0, 0xFFFF),
    "u32": (0, 0xFFFFFFFF),
    "u64": (0, 0xFFFFFFFFFFFFFFFF),
    "int": (-(1 << 63), (1 << 63) - 1),
}

_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _hints_cache.get(cls)
    if h is None:
        h = get_type_hints(cls, include_extras=True)
        _hints_cache[cls] = h
    return h


def _is_empty(v: Any, omit: str) -> bool:
    if omit == "omitempty":
        if v is None or v is False:
            return True
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
            return True
        return bool(isinstance(v, (str, bytes, list, dict, tuple)) and len(v) == 0)
    if omit == "omitzero":
        if v is None:
            return True
        if isinstance(v, TextValue):
            return v.is_zero()
        return not v
    return False


def to_obj(v: Any) -> Any:
    """Converts a message (or any value inside one) to plain JSON data."""
    if isinstance(v, TextValue):
        return v.to_text()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(v):
            name = f.metadata.get(_JSON)
            if name is None:
                continue
            val = getattr(v, f.name)
            omit = f.metadata.get(_OMIT, "")
            if omit and _is_empty(val, omit):
                continue
            if name == "":  # an embedded Go struct: its fields inline
                out.update(to_obj(val))
                continue
            out[name] = to_obj(val)
        return out
    if isinstance(v, bool) or v is None or isinstance(v, (int, str, float)):
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, (list, tuple)):
        return [to_obj(x) for x in v]
    if isinstance(v, dict):
        return {str(k): to_obj(v[k]) for k in sorted(v)}
    raise TypeError(f"cannot encode {type(v).__name__} as JSON")


def dumps(obj: Any) -> bytes:
    """Serializes plain JSON data exactly as Go's json.Marshal would."""
    s = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    s = (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
         .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    return s.encode("utf-8")


def encode(msg: Any) -> bytes:
    """Encodes a message as Go's json.Marshal encodes the same Go value."""
    return dumps(to_obj(msg))


def loads(data: bytes | str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedError(f"not JSON: {e}") from None


def decode(cls: type[T], data: bytes | str) -> T:
    """Decodes a JSON message into cls, checking every field's type."""
    out: T = from_obj(cls, loads(data), cls.__name__)
    return out


def _bad(path: str, want: str, got: Any) -> MalformedError:
    return MalformedError(f"{path}: want {want}, got {type(got).__name__} {_clip(got)}")


def _clip(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def from_obj(tp: Any, v: Any, path: str) -> Any:
    """Converts plain JSON data to the annotated type tp (Annotated ints
    carry their Go width: Annotated[int, "u64"])."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = get_args(tp)
        if base is int:
            width = meta[0] if meta else "int"
            if v is None:
                return 0
            if isinstance(v, bool) or not isinstance(v, int):
                raise _bad(path, "an integer", v)
            lo, hi = _INT_RANGES[width]
            if not lo <= v <= hi:
                raise MalformedError(f"{path}: {v} outside {lo}..{hi}")
            return v
        return from_obj(base, v, path)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if v is None:
            return None
        return from_obj(args[0], v, path)
    if tp is int:
        return from_obj(typing.Annotated[int, "int"], v, path)
    if tp is bool:
        if v is None:
            return False
        if not isinstance(v, bool):
            raise _bad(path, "a boolean", v)
        return v
    if tp is str:
        if v is None:
            return ""
        if not isinstance(v, str):
            raise _bad(path, "a string", v)
        return v
    if tp is bytes:
        if v is None:
            return b""
        if not isinstance(v, str):
            raise _bad(path, "a base64 string", v)
        try:
            return base64.b64decode(v.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise MalformedError(f"{path}: not standard base64") from None
    if origin is list:
        (et,) = get_args(tp)
        if v is None:
            return []
        if not isinstance(v, list):
            raise _bad(path, "an array", v)
        return [from_obj(et, x, f"{path}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        kt, vt = get_args(tp)
        if v is None:
            return {}
        if not isinstance(v, dict) or kt is not str:
            raise _bad(path, "an object", v)
        return {k: from_obj(vt, x, f"{path}[{k!r}]") for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, TextValue):
        if not isinstance(v, str):
            raise _bad(path, "a string", v)
        try:
            return tp.parse(v)
        except MalformedError as e:
            raise MalformedError(f"{path}: {e}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if v is None:
            v = {}
        if not isinstance(v, dict):
            raise _bad(path, "an object", v)
        return _from_dict(tp, v, path)
    if isinstance(tp, type) and issubclass(tp, int):  # IntEnum-like Go integer types
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(path, "an integer", v)
        try:
            return tp(v)
        except ValueError:
            raise MalformedError(f"{path}: {v} is not a known {tp.__name__}") from None
    raise TypeError(f"{path}: no decoder for {tp!r}")


def _from_dict(cls: type, d: dict[str, Any], path: str) -> Any:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        name = f.metadata.get(_JSON)
        if name is None:
            continue
        if name == "":
            kwargs[f.name] = _from_dict(hints[f.name], d, path)
            continue
        if name in d:
            kwargs[f.name] = from_obj(hints[f.name], d[name], f"{path}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise MalformedError(f"{path}: {e}") from None


Validator = Callable[[Any], None]
