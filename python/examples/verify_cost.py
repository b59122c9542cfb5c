"""What engine-side verification (kvtier_verify_on_engine) costs: kvsum64
of restored objects computed with torch from KV tensors shaped as vLLM's,
on the GPU when there is one (else on the CPU, labelled so).

The geometry is an 8B model's (Llama-3-8B): 32 layers, 8 KV heads of 128,
bf16, 16-token blocks, 256-token chunks; FlashAttention's K/V split by
default (64 pools of 32 KiB half pages: one object of 32 MiB per chunk).
Each "load" verifies --chunks chunks at once, as the connector verifies
one restore's objects; the block ids are a random permutation, as vLLM's
are after a while. Needs only torch and the kvtier package:

    python examples/verify_cost.py            # 4 GB on cuda:0, or 0.125 GB on the CPU
    python examples/verify_cost.py --gb 16 --chunks 64 --layout block_major
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier import _kvsum_torch

LAYERS, HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 16, 256
# kvsum64 of checksum.VectorInput(4096) (checksum/vectors.go): the device's
# int64 arithmetic must wrap as the definition's uint64 does.
VECTOR_4096 = 0x6BF1916D547F8A1D


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=None, help="KV bytes to verify per pass (default 4 GPU, 0.125 CPU)")
    ap.add_argument("--chunks", type=int, default=32, help="chunks verified together: one restore (32: 8K tokens)")
    ap.add_argument("--layout", choices=("kv_split", "block_major"), default="kv_split")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--batch-mib", type=int, default=256, help="object_sums' max_batch_bytes, in MiB")
    ap.add_argument("--compile", action="store_true", help="hash through torch.compile (kvsum use_compile)")
    ap.add_argument("--device", default=None, help="cuda:0, cpu (default: cuda when available)")
    args = ap.parse_args()
    if args.compile:
        _kvsum_torch.use_compile()
    dev = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    gb = args.gb if args.gb is not None else (4.0 if dev.type == "cuda" else 0.125)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (no GPU: not the H200 figure)"

    vec = torch.tensor([(k * 7 + 3) & 0xFF for k in range(4096)], dtype=torch.uint8, device=dev)
    got = _kvsum_torch.kvsum64(vec)
    if got != VECTOR_4096:
        raise SystemExit(f"kvsum64 on {dev}: {got:#x}, want {VECTOR_4096:#x}: the device does not wrap as expected")

    page = 2 * BLOCK * HEADS * HEAD * 2  # one layer's K and V of one block, bf16
    obj = LAYERS * (CHUNK // BLOCK) * page
    n_chunks = max(1, int(gb * (1 << 30)) // obj)
    per_load = min(args.chunks, n_chunks)
    n_chunks -= n_chunks % per_load
    num_blocks = n_chunks * (CHUNK // BLOCK) + 1  # block 0 is vLLM's null block
    gen = torch.Generator(device=dev).manual_seed(1)
    split = args.layout == "kv_split"
    shape = (2, num_blocks, BLOCK, HEADS, HEAD) if split else (num_blocks, 2, BLOCK, HEADS, HEAD)
    pools = []
    for _ in range(LAYERS):
        t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        u8 = t.view(-1).view(torch.uint8)
        u8.copy_(torch.randint(0, 256, (u8.numel(),), dtype=torch.uint8, device=dev, generator=gen))
        if split:
            pools += [_kvsum_torch.pool_pages(t[0], page // 2), _kvsum_torch.pool_pages(t[1], page // 2)]
        else:
            pools.append(_kvsum_torch.pool_pages(t, page))
    ids = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(2)) + 1)[:n_chunks * (CHUNK // BLOCK)]
    loads = ids.view(-1, per_load, CHUNK // BLOCK).to(dev)

    # The device's sums against the CPU's (checked against Go's vectors by
    # tests/test_engine_verify.py) for one object.
    if dev.type != "cpu":
        one = loads[0][:1]
        cpu = _kvsum_torch.object_sums([p.cpu() for p in pools], one.cpu())
        if _kvsum_torch.object_sums(pools, one) != cpu:
            raise SystemExit(f"{dev} and the CPU disagree on one object's sum")

    batch = args.batch_mib << 20
    _kvsum_torch.object_sums(pools, loads[0], batch)  # warm-up
    total_bytes = n_chunks * obj
    best = float("inf")
    for _ in range(args.passes):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for blocks in loads:
            _kvsum_torch.object_sums(pools, blocks, batch)  # returns ints: waits for the device
        best = min(best, time.perf_counter() - t0)
    gbs = total_bytes / best / 1e9
    per_load_ms = best / len(loads) * 1000
    mode = f"{'compiled' if args.compile else 'eager'}, batches of {args.batch_mib} MiB"
    print(f"device {label}; layout {args.layout}; {mode}; {LAYERS} layers x {HEADS} KV heads x {HEAD}, bf16, "
          f"block {BLOCK}, "
          f"chunk {CHUNK} tokens ({obj / (1 << 20):.0f} MiB per object)")
    print(f"verified {total_bytes / 1e9:.2f} GB ({n_chunks} chunks, {len(loads)} loads of {per_load} chunks) in "
          f"{best * 1000:.1f} ms (best of {args.passes}): {gbs:.2f} GB/s, {1000 / gbs:.2f} ms per GB, "
          f"{per_load_ms:.2f} ms per load of {per_load * CHUNK} tokens")


if __name__ == "__main__":
    main()
