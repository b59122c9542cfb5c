#!/usr/bin/env python3
"""KV cache round trip through kvtier on a GPU, with a real transformers model.

What it does, all on cuda:0 of this machine, with no network:

1. starts a coordinator (embedded NATS) and one rankd (--device cuda:0) from
   the Go binaries in --bin (``make gpu-build`` puts them in .gpu/);
2. builds a tiny Llama (random weights, fixed seed; nothing downloaded) and
   runs a prompt of token ids, keeping its KV cache;
3. copies that KV into paged pools laid out as vLLM's FlashInfer backend lays
   them out (per layer: num_blocks x [K|V] x block_size x kv_heads x head_dim,
   block-major), one page per block, at a random block table;
4. registers the pools with rankd by CUDA IPC (torch's handle, parsed and
   cross-checked against the driver's cuIpcGetMemHandle), stores every chunk
   with its own torch.cuda.Event(interprocess=True) (C1);
5. wipes the pools, restores every chunk through the coordinator's restore
   protocol into another block table, and checks every byte;
6. rebuilds the model's KV cache from the restored pages and checks that the
   next-token logits and a greedy continuation equal those from the original
   cache (bitwise), and from a full recompute (same argmax tokens).

Run (the nats-py wheel carried next to it, torch 2.11 + transformers there):

    pip install --no-index nats_py-*.whl
    PYTHONPATH=python/src python3 python/examples/hf_roundtrip.py --bin .gpu

It prints one table and exits 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

# Expandable segments are not cudaMalloc blocks: legacy CUDA IPC cannot name
# them, and kvtier refuses them. Set before torch initializes CUDA.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from kvtier import client, cuda, dcp, wire


def free_port() -> int:
    for _ in range(200):
        port = 20000 + random.randrange(12000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def wait_for(what: str, f, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = f()
            if v:
                return v
        except Exception as e:  # retried until the deadline
            last = e
        time.sleep(0.1)
    raise SystemExit(f"FAIL: {what} within {timeout} s ({last})")


def cache_layers(cache):
    """(key, value) per layer of a transformers cache, 4.x or 5.x."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k, v) for k, v in cache]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=".gpu", help="directory with the coordinator and rankd binaries")
    ap.add_argument("--work", default="", help="scratch directory (default: a new temp dir)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=32, help="full chunks in the prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--generate", type=int, default=16, help="greedy tokens compared after the restore")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="kvtier-hf-"))
    shutil.rmtree(work, ignore_errors=True)
    for d in ("index", "l2", "logs"):
        (work / d).mkdir(mode=0o700, parents=True)  # rankd refuses an L2 directory others can read
    bindir = pathlib.Path(args.bin)

    # ---- daemons
    nats_port, gossip = free_port(), f"127.0.0.1:{free_port()}"
    procs = []

    def start(name, argv):
        log = open(work / "logs" / f"{name}.log", "wb")  # noqa: SIM115 (lives with the process)
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    # Secure as in production: credentials for instance "hf" (TLS for 127.0.0.1).
    creds = work / "creds"
    subprocess.run([str(bindir / "coordinator"), "init", "--dir", str(creds), "--instance", "hf", "--tp-size", "1",
                    "--tls-host", "127.0.0.1"], check=True, stdout=subprocess.DEVNULL)
    start("coordinator", [str(bindir / "coordinator"), "serve", "--data-dir", str(work / "index"),
                          "--nats-host", "127.0.0.1", "--nats-port", str(nats_port), "--bind", gossip,
                          "--http", "127.0.0.1:0", "--creds-dir", str(creds)])
    start("rankd0", [str(bindir / "rankd"), "--instance", "hf", "--tp-rank", "0", "--tp-size", "1",
                     "--device", "cuda:0", "--l1-bytes", "2GiB", "--l2-dir", str(work / "l2"),
                     "--join", gossip, "--bind", f"127.0.0.1:{free_port()}", "--http", "127.0.0.1:0",
                     "--creds-dir", str(creds)])
    try:
        return run(args, torch, LlamaConfig, LlamaForCausalLM, DynamicCache, rng, nats_port, work)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def run(args, torch, LlamaConfig, LlamaForCausalLM, DynamicCache, rng, nats_port, work) -> int:
    dev = torch.device("cuda:0")
    bs, bpc = args.block_size, args.blocks_per_chunk
    chunk_tokens = bs * bpc
    n_prompt = args.chunks * chunk_tokens + 1  # the last token is computed, as vLLM does
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    prompt = torch.tensor([[rng.randrange(cfg.vocab_size) for _ in range(n_prompt)]], device=dev)
    P = n_prompt - 1
    kvh, hd, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers

    with torch.no_grad():
        out = model(input_ids=prompt[:, :P], use_cache=True)
        orig = [(k.clone(), v.clone()) for k, v in cache_layers(out.past_key_values)]
    assert orig[0][0].shape == (1, kvh, P, hd), orig[0][0].shape

    # ---- paged pools, vLLM FlashInfer layout: [num_blocks, 2, bs, kvh, hd]
    n_chunks = args.chunks
    num_blocks = 2 * n_chunks * bpc + 7
    page = 2 * bs * kvh * hd * 2  # bf16
    pools = [torch.zeros((num_blocks, 2, bs, kvh, hd), dtype=torch.bfloat16, device=dev) for _ in range(L)]
    table_a = rng.sample(range(num_blocks), n_chunks * bpc)
    table_b = rng.sample(range(num_blocks), n_chunks * bpc)

    def to_pages(layer: int, table: list[int]) -> None:
        k, v = orig[layer]
        kk = k[0].transpose(0, 1).reshape(n_chunks * bpc, bs, kvh, hd)  # [blocks, bs, kvh, hd]
        vv = v[0].transpose(0, 1).reshape(n_chunks * bpc, bs, kvh, hd)
        idx = torch.tensor(table, device=dev)
        pools[layer][idx, 0] = kk
        pools[layer][idx, 1] = vv

    def from_pages(layer: int, table: list[int]):
        idx = torch.tensor(table, device=dev)
        kk, vv = pools[layer][idx, 0], pools[layer][idx, 1]
        k = kk.reshape(P, kvh, hd).transpose(0, 1).unsqueeze(0).contiguous()
        v = vv.reshape(P, kvh, hd).transpose(0, 1).unsqueeze(0).contiguous()
        return k, v

    for layer in range(L):
        to_pages(layer, table_a)
    torch.cuda.synchronize()
    reference = [pools[layer][torch.tensor(table_a, device=dev)].clone() for layer in range(L)]

    spec = dcp.Spec(model="hf-tiny-llama-random", cache_salt=f"seed{args.seed}",
                    layout=dcp.Layout(tp=1, dcp=1, interleave=1, pp=1),
                    groups=[dcp.Group(name="full_attn", kind=dcp.Kind.ATTENTION, block_size=bs, layers=L,
                                      semantic_bytes=page, page_bytes=page, stride_bytes=page, kv_format="bf16")],
                    chunk_tokens=chunk_tokens)
    r = spec.resolve()
    tokens = prompt[0, :P].tolist()
    hashes = r.chunk_hashes(tokens)
    assert len(hashes) == n_chunks

    rows: list[tuple[str, str, bool]] = []
    opts = client.ConnectOptions(servers=[f"nats://127.0.0.1:{nats_port}"], name="hf-roundtrip", timeout=60,
                                 instance="hf", creds_dir=str(work / "creds"))
    c = wait_for("NATS reachable", lambda: client.SyncClient(opts))
    with c:
        rank = wire.Rank("hf", 0)
        st = wait_for("rankd accepts", lambda: (s := c.status(rank)).accepting and s)
        uuid = "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)
        rows.append(("rankd device", f"{st.device.backend} {st.device.uuid}", st.device.uuid == uuid))
        c.register_spec(spec)

        # Handles: torch's (parsed defensively) and the driver's must agree.
        regs = []
        agree, same_raw, checked = True, 0, 0
        for layer, t in enumerate(pools):
            h = cuda.mem_handle_from_torch(t)
            try:
                hd_ = cuda.mem_handle_from_pointer(t.data_ptr(), t.numel() * t.element_size(), uuid)
            except Exception as e:
                print(f"note: driver handle check unavailable: {e}")
            else:
                checked += 1
                agree &= (hd_.offset, hd_.size) == (h.offset, h.size)
                same_raw += hd_.raw == h.raw
            regs.append(wire.PoolRegistration(0, layer, h))
        rows.append(("torch view offset/size == driver's", f"{checked}/{L} pools checked, "
                     f"{same_raw} with identical handle bytes", agree and checked == L))
        sess = c.register(rank, spec, uuid, regs)

        # Store: every chunk its own interprocess event, recorded before the request (C1).
        t0 = time.perf_counter()
        futs = []
        for ci in range(n_chunks):
            ev = torch.cuda.Event(interprocess=True)
            ev.record(torch.cuda.current_stream())
            eh = cuda.event_handle_from_torch(ev, uuid)
            blocks = table_a[ci * bpc:(ci + 1) * bpc]
            futs.append((ev, sess.store_async("hf-prompt", [wire.ChunkBlocks(hashes[ci], [blocks])], eh)))
        replies = [f.result(120) for _, f in futs]
        store_s = time.perf_counter() - t0
        stored = sum(x.stored for x in replies)
        ok_store = stored == n_chunks and not any(x.failed or x.blocks_in_use for x in replies)
        nbytes = n_chunks * bpc * page * L
        rows.append(("store", f"{stored}/{n_chunks} chunks, {nbytes} B, {nbytes / store_s / 1e9:.2f} GB/s", ok_store))
        del futs  # events live until their store answered

        wait_for("lookup covers the prompt", lambda: c.lookup(r.namespace, hashes, "hf").prefix == n_chunks)

        # Wipe and restore into another block table.
        for p in pools:
            p.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outcome = c.restore({str(rank): sess}, hashes,
                            lambda _r, it: table_b[it.chunk * bpc:(it.chunk + 1) * bpc], instance="hf",
                            deadline_ms=30000)
        restore_s = time.perf_counter() - t0
        v = outcome.verdict
        rows.append(("restore verdict", f"{v.state if v else 'none'}, {outcome.loaded}/{n_chunks} chunks, "
                     f"{nbytes / restore_s / 1e9:.2f} GB/s", outcome.loaded == n_chunks))
        torch.cuda.synchronize()
        same = all(torch.equal(pools[layer][torch.tensor(table_b, device=dev)], reference[layer]) for layer in range(L))
        rows.append(("restored pages == stored pages", f"{nbytes} B", same))
        sess.release()

    # Logits and greedy continuation from the restored cache.
    with torch.no_grad():
        def continue_from(pairs):
            cache = DynamicCache()
            for layer, (k, v) in enumerate(pairs):
                cache.update(k, v, layer)
            o = model(input_ids=prompt[:, P:], past_key_values=cache, use_cache=True)
            logits = o.logits[:, -1].float()
            toks, cache = [], o.past_key_values
            nxt = logits.argmax(-1, keepdim=True)
            for _ in range(args.generate):
                toks.append(int(nxt))
                o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            return logits, toks

        restored_pairs = [from_pages(layer, table_b) for layer in range(L)]
        same_kv = all(torch.equal(k0, k1) and torch.equal(v0, v1)
                      for (k0, v0), (k1, v1) in zip(orig, restored_pairs, strict=True))
        rows.append(("restored K/V == original K/V", f"{L} layers x {P} tokens", same_kv))
        lo_orig, toks_orig = continue_from([(k.clone(), v.clone()) for k, v in orig])
        lo_rest, toks_rest = continue_from(restored_pairs)
        rows.append(("next-token logits (restored vs original cache)", "bitwise", torch.equal(lo_orig, lo_rest)))
        rows.append((f"greedy {args.generate} tokens (restored vs original)", str(toks_rest[:8]) + "...",
                     toks_orig == toks_rest))
        full = model(input_ids=prompt, use_cache=False).logits[:, -1].float()
        diff = (full - lo_rest).abs().max().item()
        rows.append(("next token vs full recompute", f"max |dlogit| {diff:.3g}",
                     int(full.argmax()) == int(lo_rest.argmax())))

    w = max(len(a) for a, _, _ in rows)
    print(f"\nkvtier HF round trip: Llama {L} layers, {n_prompt}-token prompt, chunk {chunk_tokens} tokens, "
          f"page {page} B, work dir {work}")
    for a, b, ok in rows:
        print(f"  {a:<{w}}  {'ok  ' if ok else 'FAIL'}  {b}")
    ok = all(ok for _, _, ok in rows)
    print("RESULT", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
