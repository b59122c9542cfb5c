"""kvtier's dcp.Spec from vLLM's KVCacheConfig, failing closed.

The page size of every group comes from the spec's ``page_size_bytes``
(C2: never from a tensor shape); the semantic size from
``real_page_size_bytes`` (attention) or the state shapes (Mamba). Pools are
registered block-major: block b of a layer at ``b * page_size_bytes`` of
that layer's tensor, which is what vLLM's FlashInfer, MLA and Mamba layouts
give; the worker checks every tensor against it before registering and
refuses anything else (for example FlashAttention's K/V-split layout
``(2, num_blocks, ...)``).

Only specs this module knows are accepted: FullAttentionSpec,
MLAAttentionSpec, SlidingWindowSpec and MambaSpec, matched by class name
exactly (a subclass it does not know may change the page meaning, so it is
refused). Everything else raises GeometryError naming the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier import dcp
from kvtier.errors import GeometryError

_ATTENTION = {"FullAttentionSpec": dcp.Kind.ATTENTION, "MLAAttentionSpec": dcp.Kind.ATTENTION,
              "SlidingWindowSpec": dcp.Kind.SLIDING_WINDOW}
_RECURRENT = {"MambaSpec": dcp.Kind.RECURRENT}


@dataclass(frozen=True)
class GroupLayers:
    """The vLLM layer names of one kvtier group, in pool order."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int


def _dtype_name(dtype: Any) -> str:
    s = str(dtype)
    return s.removeprefix("torch.")


def _dtype_size(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    raise GeometryError(f"dtype {dtype!r} has no known size")


def group_from_vllm(i: int, layer_names: list[str], s: Any) -> dcp.Group:
    """One dcp.Group from a vLLM KVCacheSpec, or GeometryError."""
    cls = type(s).__name__
    page = getattr(s, "page_size_bytes", None)
    bs = getattr(s, "block_size", None)
    if not isinstance(page, int) or page < 1 or not isinstance(bs, int) or bs < 1:
        raise GeometryError(f"KV cache group {i} ({cls}): page_size_bytes {page!r} or block_size {bs!r} is not "
                            "a positive integer")
    if not layer_names:
        raise GeometryError(f"KV cache group {i} ({cls}) has no layers")
    if cls in _ATTENTION:
        mla = cls == "MLAAttentionSpec"
        semantic = getattr(s, "real_page_size_bytes", page)
        fmt = getattr(s, "cache_dtype_str", None) or _dtype_name(getattr(s, "dtype", "?"))
        quant = getattr(s, "kv_quant_mode", 0)
        if int(quant or 0) != 0:
            fmt += f"+q{int(quant)}"
        kind = _ATTENTION[cls]
    elif cls in _RECURRENT:
        mla = False
        mode = getattr(s, "mamba_cache_mode", "none")
        if mode != "all":
            raise GeometryError(f"KV cache group {i} (MambaSpec): mamba_cache_mode {mode!r}; the connector maps "
                                "block i to tokens [i*block_size, (i+1)*block_size), which holds only with 'all'")
        shapes, dtypes = getattr(s, "shapes", ()), getattr(s, "dtypes", ())
        if len(shapes) != len(dtypes) or not shapes:
            raise GeometryError(f"KV cache group {i} (MambaSpec): {len(shapes)} state shapes, {len(dtypes)} dtypes")
        semantic = sum(math.prod(sh) * _dtype_size(dt) for sh, dt in zip(shapes, dtypes, strict=True))
        fmt = "mamba:" + getattr(s, "mamba_type", "?") + ":" + ",".join(_dtype_name(d) for d in dtypes)
        kind = _RECURRENT[cls]
    else:
        raise GeometryError(f"KV cache group {i}: vLLM spec {cls} is not one kvtier understands "
                            f"(FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, MambaSpec); refusing it")
    if not isinstance(semantic, int) or not 1 <= semantic <= page:
        raise GeometryError(f"KV cache group {i} ({cls}): semantic page {semantic!r} B outside 1..{page} B "
                            "(the declared page_size_bytes)")
    return dcp.Group(name=f"g{i}:{cls}", kind=kind, mla=mla, block_size=bs, layers=len(layer_names),
                     semantic_bytes=semantic, page_bytes=page, stride_bytes=page, kv_format=fmt)


def spec_from_vllm(kv_cache_config: Any, model: str, cache_salt: str, tp: int, dcp_size: int, pp: int,
                   chunk_tokens: int | None) -> tuple[dcp.Spec, list[GroupLayers]]:
    """kvtier's Spec for a vLLM KVCacheConfig, and each group's layers."""
    groups_in = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups_in:
        raise GeometryError("vLLM kv_cache_config has no kv_cache_groups")
    if dcp_size != 1:
        raise GeometryError(f"decode context parallel size {dcp_size}: the connector maps vLLM block tables "
                            "only for DCP 1 (kvtier's DCP geometry is not yet verified against vLLM's)")
    groups: list[dcp.Group] = []
    layers: list[GroupLayers] = []
    for i, g in enumerate(groups_in):
        names = list(getattr(g, "layer_names", []) or [])
        grp = group_from_vllm(i, names, getattr(g, "kv_cache_spec", None))
        groups.append(grp)
        layers.append(GroupLayers(tuple(names), grp.block_size, grp.page_bytes))
    block = 1
    for grp in groups:
        block = math.lcm(block, grp.block_size * (dcp_size if grp.kind != dcp.Kind.RECURRENT else 1))
    chunk = chunk_tokens or block
    spec = dcp.Spec(model=model, cache_salt=cache_salt, layout=dcp.Layout(tp=tp, dcp=dcp_size, interleave=1, pp=pp),
                    groups=groups, chunk_tokens=chunk)
    spec.resolve()  # every rule, with the numbers, before anything registers
    return spec, layers
