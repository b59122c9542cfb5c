"""kvtier's dcp.Spec from vLLM's KVCacheConfig, failing closed.

The page size of every group comes from the spec's ``page_size_bytes``
(C2: never from a tensor shape); the semantic size from
``real_page_size_bytes`` (attention) or the state shapes (Mamba). Pools are
registered in one of two layouts, chosen by configuration because the
scheduler never sees a tensor and both sides must derive the same spec:

- ``block_major`` (default): block b of a layer at ``b * page_size_bytes``
  of that layer's tensor: vLLM's FlashInfer, MLA and Mamba layouts;
- ``kv_split``: FlashAttention's ``(2, num_blocks, ...)``, K and V halves
  num_blocks apart. Each non-MLA attention layer is then two kvtier pools
  (K, V) of half pages, so the group has twice the layers and a page of
  page_size_bytes / 2; a padded page (page_size_padded) cannot be split and
  is refused.

The worker checks every tensor against the layout before registering and
refuses anything else.

Only specs this module knows are accepted: FullAttentionSpec,
MLAAttentionSpec, SlidingWindowSpec and MambaSpec, matched by class name
exactly (a subclass it does not know may change the page meaning, so it is
refused). Everything else raises GeometryError naming the group.

Several KV cache groups (vLLM's hybrid allocator, HMA): every group of the
kv_cache_config is one kvtier group with its own page geometry (its
page_size_bytes) and its own block ids (vLLM's per-group block id lists); a
chunk is one object per group and rank, and the coordinator restores a
chunk only when every group's objects are COMPLETE. The connector declares
vLLM's SupportsHMA, so vLLM keeps HMA on for it. With several groups vLLM
0.32 refuses block-level load errors (block ids are unique only within a
group: Scheduler._handle_invalid_blocks raises), so a failed load is
reported per request (KVConnectorTransferResults.failed_recving: vLLM
recomputes the whole request) and loads must be asynchronous
(kvtier_load_async true; a synchronous load's failure has no such channel).
A vLLM without get_transfer_results (0.26) has no channel at all for it: no
load of several groups is offered there (_Core.loads_off).
With one group the block-level errors stay (only the failed chunks are
recomputed).

Sliding-window groups under HMA: vLLM frees a request's blocks that fall
out of the window and puts its null block (block id 0, the BlockPool's
first block, shared by every group) in their place, also for the blocks of
tokens restored from outside the window. kvtier therefore (i) stores a
chunk only when every group's blocks of it are real (no null block), and
(ii) offers the scheduler only chunks whose sliding-window blocks vLLM will
allocate for real: a restored prefix of T tokens is offered only while
(T - window + 1) // block_size blocks, the ones vLLM skips, lie inside the
prefix vLLM already holds locally. A longer prefix is cut back to that
(recomputed). A store also waits (at most kvtier_timeout_s) for its answer
in wait_for_save when the spec has a sliding-window group: vLLM frees
out-of-window blocks at its next schedule without asking the connector, so
the rankd must have read them first.

Mamba / linear-attention state groups (MambaSpec) are accepted in vLLM's
mamba_cache_mode "align" (its default with prefix caching) and refused in
"none" (one state block per request, no state at any chunk boundary). In
"align" vLLM keeps the state after token B only when B is a multiple of
its Mamba block size and a scheduler step ends there (or B is the prompt's
last such position, a checkpoint Mamba2 exports from inside the step), and
of those only what its prefix_cache_retention_interval retains (by default
the prompt's last); the blocks before are its null block. A chunk's Mamba object is therefore one
opaque page, the state at the chunk's end: kvtier's recurrent group has a
block of chunk_tokens (one page per chunk), and the chunk must be a
multiple of vLLM's Mamba block size. The scheduler side stores a chunk
only when vLLM handed it that boundary's state block
(KVConnectorBlockState.boundary_state_offloads); a restore places the
Mamba object of its last chunk only, in the block vLLM allocates for the
restored prefix's state (see kvtier.vllm._scheduler). Refused as not
verified against vLLM: speculative Mamba blocks (EAGLE/MTP relocate them)
and DCP > 1.

PP > 1 (pipeline parallel, vLLM's pipeline_parallel_size P): each stage
holds its own layers on its own GPUs, so each stage is a kvtier world of
its own: its spec has its own layer count and names the stage
(dcp.Layout.pp_stage), so it has its own namespace and chunk hashes, and
its ranks are instance "<kvtier_instance>-pp<stage>" (stage_instance; run
each stage's rankds with that instance). The scheduler looks a request up
in every stage's namespace and restores only the prefix that every stage
holds COMPLETE; each worker stores and restores its stage's objects and
waits for its stage's verdict, and vLLM counts a load finished only when
every worker reported it. The scheduler sees only stage 0's
kv_cache_config, so it derives the other stages' specs from vLLM's layer
partition (vllm.distributed.utils.get_pp_indices, VLLM_PP_LAYER_PARTITION
included): this is exact for a model of one KV cache group that holds
every decoder layer, and anything else is refused (several groups, a
group that skips layers); every worker checks that the spec the scheduler
derives for its stage is the one its own kv_cache_config gives.

DCP (decode context parallel, vLLM's decode_context_parallel_size W):
vLLM deals each token of a scheduler block of block_size*W tokens to DCP
rank (offset // interleave) % W, the DCP rank of TP rank t being t % W
(vllm/v1/worker/block_table.py, distributed/parallel_state.py); kvtier's
dcp.Layout.local_slot is that mapping (tests/test_vllm_dcp.py runs vLLM's
own slot-mapping kernel against it). The spec's block_size is a rank's
(vLLM multiplies it by W for the scheduler's block ids), so a group spans
block_size*W tokens and every rank stores and restores its own pages of the
chunk's block ids. The interleave comes from cp_kv_cache_interleave_size.
Refused: prefill context parallel (PCP) > 1, and an attention group vLLM
marks not DCP-sharded (dcp_sharded False) under DCP > 1 (its blocks would
span block_size tokens, not block_size*W).

Per-request cache salt (vLLM's ``Request.cache_salt``, set per prompt):
:func:`request_chunk_hashes` starts a salted request's hash chain from a
seed derived from the namespace and the salt instead of from the namespace
itself, so requests share chunks only when they share the salt (vLLM does
the same with its own block hashes: the salt enters the first block's). A
request without a salt (None or "") keeps the namespace as the seed: the
chunk hashes every kvtier client computes, and every cache stored before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

from kvtier import dcp
from kvtier.errors import GeometryError

_ATTENTION = {"FullAttentionSpec": dcp.Kind.ATTENTION, "MLAAttentionSpec": dcp.Kind.ATTENTION,
              "SlidingWindowSpec": dcp.Kind.SLIDING_WINDOW}
_RECURRENT = {"MambaSpec": dcp.Kind.RECURRENT}


LAYOUT_BLOCK_MAJOR = "block_major"
LAYOUT_KV_SPLIT = "kv_split"


@dataclass(frozen=True)
class GroupLayers:
    """The vLLM layer names of one kvtier group, in pool order, and how a
    layer's tensor maps to pools."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int  # vLLM's page_size_bytes of one layer (K and V)
    kv_split: bool = False  # each layer is two pools: K then V, half pages
    sliding_window: int = 0  # SlidingWindowSpec's window in tokens (0: none)
    # MambaSpec (mamba_cache_mode "align"): block_size is vLLM's Mamba block
    # (the state after token B lives in the request's block B // block_size
    # - 1), and kvtier's group has one page per chunk: the state at its end.
    recurrent: bool = False


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
        if getattr(s, "non_causal", False):
            # bidirectional attention: a token's KV depends on tokens after
            # it, so a prefix-chained chunk hash does not name it
            raise GeometryError(f"KV cache group {i} ({cls}) is non-causal (prefix LM): its KV is not a function "
                                "of the prefix; refusing it")
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
        if mode != "align":
            raise GeometryError(f"KV cache group {i} (MambaSpec): mamba_cache_mode {mode!r}; kvtier stores the state "
                                "at a chunk boundary as the chunk's recurrent page, which vLLM keeps only in "
                                "'align' (its default with prefix caching); 'none' keeps one state block per "
                                "request")
        spec_blocks = getattr(s, "num_speculative_blocks", 0)
        if spec_blocks:
            raise GeometryError(f"KV cache group {i} (MambaSpec): {spec_blocks} speculative blocks (EAGLE/MTP) "
                                "move state blocks within the request's table; not verified against vLLM, "
                                "refusing it")
        shapes, dtypes = getattr(s, "shapes", ()), getattr(s, "dtypes", ())
        if len(shapes) != len(dtypes) or not shapes:
            raise GeometryError(f"KV cache group {i} (MambaSpec): {len(shapes)} state shapes, {len(dtypes)} dtypes")
        semantic = sum(math.prod(sh) * _dtype_size(dt) for sh, dt in zip(shapes, dtypes, strict=True))
        mtype = getattr(s, "mamba_type", "?")  # vLLM's MambaAttentionBackendEnum (MAMBA2: "mamba2")
        mtype = str(getattr(mtype, "name", mtype)).lower()
        fmt = "mamba:" + mtype + ":" + ",".join(_dtype_name(d) for d in dtypes)
        kind = _RECURRENT[cls]
    else:
        raise GeometryError(f"KV cache group {i}: vLLM spec {cls} is not one kvtier understands "
                            f"(FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, MambaSpec); refusing it")
    if not isinstance(semantic, int) or not 1 <= semantic <= page:
        raise GeometryError(f"KV cache group {i} ({cls}): semantic page {semantic!r} B outside 1..{page} B "
                            "(the declared page_size_bytes)")
    return dcp.Group(name=f"g{i}:{cls}", kind=kind, mla=mla, block_size=bs, layers=len(layer_names),
                     semantic_bytes=semantic, page_bytes=page, stride_bytes=page, kv_format=fmt)


# SALT_DOMAIN separates a salted chain's seed from every other SHA-256 input
# kvtier hashes (namespaces, chunk hashes).
SALT_DOMAIN = b"kvtier/request-salt/v1"


def salted_seed(ns: dcp.Namespace, cache_salt: str) -> bytes:
    """The first link of a salted request's chunk-hash chain:
    SHA-256(SALT_DOMAIN || namespace || u64 big-endian length of the salt
    || the salt as UTF-8)[:16]."""
    b = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(SALT_DOMAIN + bytes(ns) + struct.pack(">Q", len(b)) + b).digest()[:16]


def request_chunk_hashes(r: dcp.Resolved, tokens: list[int], cache_salt: str | None) -> list[dcp.ChunkHash]:
    """The chunk hashes of one request: the namespace's prefix-chained
    hashes (dcp.chunk_hashes) without a salt; with one, the same chain
    started from salted_seed instead of the namespace."""
    if not cache_salt:
        return r.chunk_hashes(tokens)
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt {type(cache_salt).__name__}: want a string")
    return dcp.chunk_hashes(dcp.Namespace(salted_seed(r.namespace, cache_salt)), tokens, r.spec.chunk_tokens)


# DEFAULT_CHUNK_TOKENS is the least number of tokens of a default chunk
# (kvtier_chunk_tokens overrides it).
DEFAULT_CHUNK_TOKENS = 256


def spec_from_vllm(kv_cache_config: Any, model: str, cache_salt: str, tp: int, dcp_size: int, pp: int,
                   chunk_tokens: int | None,
                   layout: str = LAYOUT_BLOCK_MAJOR, interleave: int = 1,
                   pcp_size: int = 1, pp_stage: int = 0) -> tuple[dcp.Spec, list[GroupLayers]]:
    """kvtier's Spec for a vLLM KVCacheConfig (of pipeline stage pp_stage),
    and each group's layers."""
    if layout not in (LAYOUT_BLOCK_MAJOR, LAYOUT_KV_SPLIT):
        raise GeometryError(f"pool layout {layout!r}: want {LAYOUT_BLOCK_MAJOR} or {LAYOUT_KV_SPLIT}")
    groups_in = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups_in:
        raise GeometryError("vLLM kv_cache_config has no kv_cache_groups")
    if not 0 <= pp_stage < pp:
        raise GeometryError(f"pipeline stage {pp_stage} of pipeline parallel size {pp}")
    if pcp_size != 1:
        raise GeometryError(f"prefill context parallel size {pcp_size}: the connector supports PCP 1 only")
    if dcp_size < 1 or interleave < 1:
        raise GeometryError(f"decode context parallel size {dcp_size}, interleave {interleave}: want >= 1")
    groups: list[dcp.Group] = []
    layers: list[GroupLayers] = []
    for i, g in enumerate(groups_in):
        names = list(getattr(g, "layer_names", []) or [])
        vspec = getattr(g, "kv_cache_spec", None)
        grp = group_from_vllm(i, names, vspec)
        if dcp_size > 1 and grp.kind == dcp.Kind.RECURRENT:
            raise GeometryError(f"KV cache group {i} (MambaSpec) under decode context parallel size {dcp_size}: "
                                "not verified against vLLM; refusing it")
        if dcp_size > 1 and getattr(vspec, "dcp_sharded", True) is not True:
            raise GeometryError(f"KV cache group {i} ({type(vspec).__name__}) is not DCP-sharded under decode "
                                f"context parallel size {dcp_size}: its blocks span block_size tokens, kvtier's "
                                "attention groups block_size*DCP; refusing it")
        split = layout == LAYOUT_KV_SPLIT and grp.kind != dcp.Kind.RECURRENT and not grp.mla
        vllm_page = grp.page_bytes
        if split:
            if grp.semantic_bytes != grp.page_bytes or grp.page_bytes % 2:
                raise GeometryError(
                    f"KV cache group {i}: page of {grp.page_bytes} B (semantic {grp.semantic_bytes} B) cannot be "
                    "split into K and V halves (padded or odd page)")
            half = grp.page_bytes // 2
            grp = dcp.Group(name=grp.name, kind=grp.kind, mla=False, block_size=grp.block_size,
                            layers=2 * grp.layers, semantic_bytes=half, page_bytes=half, stride_bytes=half,
                            kv_format=grp.kv_format + ":kv_split")
        groups.append(grp)
        window = 0
        if grp.kind == dcp.Kind.SLIDING_WINDOW:
            w = getattr(vspec, "sliding_window", None)
            if not isinstance(w, int) or w < 1:
                raise GeometryError(f"KV cache group {i} (SlidingWindowSpec): sliding_window {w!r} is not a "
                                    "positive integer")
            window = w
        layers.append(GroupLayers(tuple(names), grp.block_size, vllm_page, split, window,
                                  grp.kind == dcp.Kind.RECURRENT))
    block = 1
    for grp in groups:
        block = math.lcm(block, grp.block_size * (dcp_size if grp.kind != dcp.Kind.RECURRENT else 1))
    # The default chunk is the smallest whole number of blocks of at least
    # DEFAULT_CHUNK_TOKENS: a chunk is one object per rank and group and one
    # checksum, so one-block chunks (16 tokens on a GPU build) make the
    # per-object costs dominate; a prompt shorter than one chunk plus a
    # token is never stored.
    chunk = chunk_tokens or block * max(1, -(-DEFAULT_CHUNK_TOKENS // block))
    for gi, grp in enumerate(groups):
        if grp.kind != dcp.Kind.RECURRENT:
            continue
        if chunk % grp.block_size:
            raise GeometryError(f"KV cache group {gi} (MambaSpec): chunk of {chunk} tokens is not a multiple of "
                                f"vLLM's Mamba block of {grp.block_size} tokens: vLLM keeps a state only at a "
                                "multiple of its Mamba block, so a chunk's end would have none")
        # One page per chunk, the state at the chunk's end: vLLM keeps no
        # state inside it (kvtier.vllm._scheduler places it).
        groups[gi] = dcp.Group(name=grp.name, kind=grp.kind, mla=False, block_size=chunk, layers=grp.layers,
                               semantic_bytes=grp.semantic_bytes, page_bytes=grp.page_bytes,
                               stride_bytes=grp.stride_bytes, kv_format=grp.kv_format)
    spec = dcp.Spec(model=model, cache_salt=cache_salt,
                    layout=dcp.Layout(tp=tp, dcp=dcp_size, interleave=interleave, pp=pp, pp_stage=pp_stage),
                    groups=groups, chunk_tokens=chunk)
    spec.resolve()  # every rule, with the numbers, before anything registers
    return spec, layers


def stage_instance(instance: str, pp: int, stage: int) -> str:
    """The kvtier instance of pipeline stage `stage`: the configured one
    under PP 1, else "<instance>-pp<stage>" (a stage is a world of its
    own: its TP ranks must not be another stage's)."""
    if pp <= 1:
        return instance
    name = f"{instance}-pp{stage}"
    if len(name) > 64:
        raise GeometryError(f"kvtier instance {instance!r}: the stage instance {name!r} is over 64 characters")
    return name


def stage_specs(spec: dcp.Spec, layers: list[GroupLayers], stage_layers: list[int]) -> list[dcp.Spec]:
    """Every pipeline stage's spec, derived from one stage's (spec, whose
    layout names its stage and PP size, and its groups' vLLM layers) and
    vLLM's layer partition (stage_layers: the decoder layers of each
    stage). Exact only for one KV cache group holding every decoder layer
    of its stage; anything else raises GeometryError naming why."""
    lay = spec.layout
    if len(stage_layers) != lay.pp:
        raise GeometryError(f"layer partition of {len(stage_layers)} stages for pipeline parallel size {lay.pp}")
    if lay.pp == 1:
        return [spec]
    if len(spec.groups) != 1:
        raise GeometryError(
            f"pipeline parallel size {lay.pp} with {len(spec.groups)} KV cache groups: vLLM's scheduler sees only "
            "stage 0's kv_cache_config, so another stage's groups (its layers of each) cannot be derived; the "
            "connector supports PP > 1 for models of one KV cache group")
    g = spec.groups[0]
    own, have = stage_layers[lay.pp_stage], len(layers[0].layer_names)
    if have != own:
        raise GeometryError(
            f"pipeline stage {lay.pp_stage}: KV cache group {g.name or 0} holds {have} layers, vLLM's layer partition "
            f"gives the stage {own} decoder layers: the group does not hold every decoder layer, so another stage's "
            "layers cannot be derived; refusing PP > 1 for this model")
    per = g.layers // own  # kvtier pools per decoder layer (2 under kv_split)
    out = []
    for st, n in enumerate(stage_layers):
        if n < 1:
            raise GeometryError(f"pipeline stage {st} has {n} decoder layers")
        gs = dataclasses.replace(g, layers=n * per)
        out.append(dataclasses.replace(spec, layout=dataclasses.replace(lay, pp_stage=st), groups=[gs]))
    for s in out:
        s.resolve()
    return out
