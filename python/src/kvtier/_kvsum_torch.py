"""kvsum64 (Go package checksum) computed with torch on the tensors where
the bytes are, and the same in plain Python as the reference.

The connector's engine-side verification (kvtier_verify_on_engine) sums
the pages a restore placed into vLLM's KV tensors, on the engine's device,
and compares each object's sum with the one the coordinator recorded at
store time: the rankd that placed the pages is then not trusted to have
placed what it verified.

kvsum64 over an object of n bytes, with w_i its little-endian 8-byte words
(the last zero-padded):

    t_i = fmix64(w_i ^ (i*K1 + K2)),  P = sum of t_i,  H = fmix64(P ^ (n*K2) ^ K1)

all mod 2^64. torch has no unsigned 64-bit arithmetic on every device, so
the words are int64: addition and multiplication wrap alike in two's
complement, and the logical right shift fmix64 needs is the arithmetic
one with the sign bits masked off.

An object's bytes are its pages packed as the rankd packs them
(transfer.pageSpans): layer (pool) by layer, and within a layer block by
block in the item's order, each page ``page_bytes`` long. So the word index
of word w of block k of pool p is ``(p*B + k)*W + w`` for B blocks of W
words, when a page is a whole number of words; otherwise the pages are
gathered into one buffer first. checksum/testdata/packed_object.json,
written by the Go packing, pins the order (tests/test_engine_verify.py).

torch is imported where it is used, never at import time (the package does
not depend on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

K1 = 0x9E3779B97F4A7C15
K2 = 0xC2B2AE3D27D4EB4F
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_U64 = (1 << 64) - 1
_LOW31 = (1 << 31) - 1  # what is left of a 64-bit word after a logical shift by 33


def _signed(x: int) -> int:
    """x mod 2^64 as the int64 with the same bits."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int."""
    x &= _U64
    x ^= x >> 33
    x = (x * _M1) & _U64
    x ^= x >> 33
    x = (x * _M2) & _U64
    return x ^ (x >> 33)


def finish(partial: int, n: int) -> int:
    """The digest of an object of n bytes from its full partial sum."""
    return fmix64((partial & _U64) ^ ((n * K2) & _U64) ^ K1)


def kvsum64_ref(data: bytes | bytearray | memoryview) -> int:
    """kvsum64 of data, word by word in plain Python: the reference the
    torch code is tested against (slow; for tests and small inputs)."""
    b = bytes(data)
    n = len(b)
    padded = b + bytes(-n % 8)
    partial = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        partial += fmix64(w ^ ((i * K1 + K2) & _U64))
    return finish(partial, n)


def pack_ref(pools: Sequence[bytes | bytearray | memoryview], blocks: Sequence[int], page_bytes: int,
             stride_bytes: int | None = None) -> bytes:
    """An object's bytes as the rankd packs them: every pool (layer) in
    order, in each the pages of blocks in order."""
    stride = page_bytes if stride_bytes is None else stride_bytes
    out = bytearray()
    for pool in pools:
        mv = memoryview(pool)
        for b in blocks:
            out += mv[b * stride:b * stride + page_bytes]
    return bytes(out)


def _fmix_(x: Any) -> Any:
    """fmix64 in place on an int64 tensor."""
    x ^= (x >> 33) & _LOW31
    x *= _signed(_M1)
    x ^= (x >> 33) & _LOW31
    x *= _signed(_M2)
    x ^= (x >> 33) & _LOW31
    return x


def _hash_sum_eager(words: Any, key: Any) -> Any:
    """The partial sums of objects whose words are words (int64, (pools,
    objects, words per pool)) and whose word indices' keys are key
    ((pools, 1, words per pool)): object i's is the sum over p and j of
    fmix64(words[p, i, j] ^ key[p, 0, j]). words is overwritten."""
    words ^= key
    return _fmix_(words).sum(dim=(0, 2))


_hash_sum = _hash_sum_eager


def use_compile(on: bool = True) -> None:
    """Runs the hashing through torch.compile (one fused kernel instead of
    about a dozen passes over the words), or back in eager mode. The first
    call of each shape compiles (seconds)."""
    global _hash_sum
    if not on:
        _hash_sum = _hash_sum_eager
        return
    import torch

    _hash_sum = torch.compile(_hash_sum_eager, dynamic=True)


def _finish_all(partial: Any, n: int) -> list[int]:
    """The digests of objects of n bytes from their partial sums (an int64
    tensor), as Python ints in 0..2^64-1."""
    x = partial ^ _signed((n * K2) ^ K1)
    return [v & _U64 for v in _fmix_(x).tolist()]


def kvsum64(data: Any) -> int:
    """kvsum64 of a 1-D uint8 tensor, on its device."""
    import torch

    n = int(data.numel())
    if n % 8:
        data = torch.cat([data, data.new_zeros(8 - n % 8)])
    words = data.contiguous().view(torch.int64).clone()
    idx = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    words ^= idx * _signed(K1) + _signed(K2)
    partial = _fmix_(words).sum().reshape(1)
    return _finish_all(partial, n)[0]


def pool_pages(pool: Any, page_bytes: int) -> Any:
    """One layer's pool as a (blocks, page_bytes) uint8 view without a copy:
    the pool must be dense, block after block (the connector's layout
    check makes sure of it)."""
    import torch

    u8 = pool.reshape(-1).view(torch.uint8)
    if u8.numel() % page_bytes:
        raise ValueError(f"pool of {u8.numel()} B is not a whole number of {page_bytes} B pages")
    return u8.view(-1, page_bytes)


def object_sums(pools: Sequence[Any], blocks: Any, max_batch_bytes: int = 256 << 20) -> list[int]:
    """kvsum64 of the objects of one group: pools are the group's layers in
    pool order, each a (num_blocks, page_bytes) uint8 view (pool_pages);
    blocks is an int64 tensor (objects, blocks per object) of block ids on
    the pools' device. Returns each object's digest. The pages are
    gathered and hashed in batches of at most max_batch_bytes (at least one
    pool's pages of one object), so the engine's device lends at most about
    twice that for the duration (the gathered words and one temporary of
    their size). With whole-word pages a batch holds whole pools of as many
    objects as fit, so each pool is gathered once per call whatever the
    batch (a gather per pool is most of the cost of a small call)."""
    if blocks.dim() != 2 or not pools:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)} and {len(pools)} pools: "
                         "want (objects, blocks) and at least one pool")
    n, nb = int(blocks.shape[0]), int(blocks.shape[1])
    page = int(pools[0].shape[1])
    if any(int(p.shape[1]) != page for p in pools):
        raise ValueError("pools of different page sizes in one group")
    size = len(pools) * nb * page
    aligned = page % 8 == 0 and all(p.data_ptr() % 8 == 0 for p in pools)
    per = max(1, max_batch_bytes // max(1, nb * page if aligned else size))
    out: list[int] = []
    for lo in range(0, n, per):
        part = blocks[lo:lo + per]
        partial = (_partials_aligned(pools, part, page, max_batch_bytes) if aligned
                   else _partials_gathered(pools, part, page))
        out += _finish_all(partial, size)
    return out


def _partials_aligned(pools: Sequence[Any], blocks: Any, page: int, max_batch_bytes: int) -> Any:
    """Partial sums when every page is whole words: the pages of as many
    pools as fit in max_batch_bytes are gathered as words into one buffer
    (one copy per pool) and hashed in one pass with their word indices in
    the object."""
    import torch

    n, nb = int(blocks.shape[0]), int(blocks.shape[1])
    w = page // 8
    flat = blocks.reshape(-1)
    dev = flat.device
    group = max(1, min(len(pools), max_batch_bytes // (n * nb * page)))
    buf = torch.empty((group, n * nb, w), dtype=torch.int64, device=dev)
    # Word (p*nb + k)*w + j of an object is page k's word j in pool p.
    key = (torch.arange(len(pools) * nb * w, dtype=torch.int64, device=dev) * _signed(K1) + _signed(K2)).view(
        len(pools), 1, nb * w)
    partial = torch.zeros(n, dtype=torch.int64, device=dev)
    for lo in range(0, len(pools), group):
        hi = min(lo + group, len(pools))
        for p in range(lo, hi):
            torch.index_select(pools[p].view(torch.int64), 0, flat, out=buf[p - lo])
        # buf[p - lo, i*nb + k, j] is page k's word j in pool p of object i.
        partial += _hash_sum(buf[:hi - lo].view(hi - lo, n, nb * w), key[lo:hi])
    return partial


def _partials_gathered(pools: Sequence[Any], blocks: Any, page: int) -> Any:
    """Partial sums when pages are not whole words: the objects are packed
    into one buffer, zero-padded to whole words, and hashed."""
    import torch

    n, nb = int(blocks.shape[0]), int(blocks.shape[1])
    flat = blocks.reshape(-1)
    parts = [pool.index_select(0, flat).view(n, nb * page) for pool in pools]
    size = len(pools) * nb * page
    if size % 8:
        parts.append(torch.zeros(n, 8 - size % 8, dtype=torch.uint8, device=flat.device))
    words = torch.cat(parts, dim=1).view(torch.int64)
    idx = torch.arange(words.shape[1], dtype=torch.int64, device=flat.device)
    return _hash_sum(words.unsqueeze(0), (idx * _signed(K1) + _signed(K2)).view(1, 1, -1))


__all__ = ["K1", "K2", "finish", "fmix64", "kvsum64", "kvsum64_ref", "object_sums", "pack_ref", "pool_pages",
           "use_compile"]
