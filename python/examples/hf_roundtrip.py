#!/usr/bin/env python3
"""KV cache round trip through kvtier, with a real transformers model, over
one or several tensor-parallel rankds.

What it does, with no network:

1. starts a coordinator (embedded NATS, nkey auth, TLS) and --ranks rankds
   (TP ranks 0..N-1 of one instance, all on cuda:0, or all on the host
   backend with --device host) from the Go binaries in --bin
   (``make gpu-build`` puts them in .gpu/);
2. builds a tiny Llama (random weights, fixed seed; nothing downloaded) and
   runs a prompt of token ids, keeping its KV cache;
3. shards that KV over the TP ranks as vLLM shards KV heads (rank r of N
   holds heads [r*H/N, (r+1)*H/N); with fewer heads than ranks each head is
   replicated on N/H consecutive ranks) and copies every rank's shard into
   its own paged pools, laid out as vLLM's FlashInfer backend lays them out
   (per layer: num_blocks x [K|V] x block_size x heads_per_rank x head_dim,
   block-major), one page per block, at one random block table shared by
   all ranks (vLLM's scheduler gives every TP rank the same block ids);
4. registers every rank's pools with its own rankd (CUDA IPC: torch's
   handle, parsed and cross-checked against the driver's cuIpcGetMemHandle;
   or host-backend shared memory), and every rank stores every chunk of its
   shard, each store request with its own interprocess event (C1): by
   default one request per rank with every chunk, as vLLM's connector
   stores what one forward step (here the prompt's one prefill) completed;
   --chunks-per-store N splits it into requests of N chunks;
5. wipes all pools, restores every chunk through the coordinator's restore
   protocol (one restore, every rank retrieving its own shard) into another
   block table, and checks every byte of every rank's pages;
6. rebuilds the model's KV cache from the ranks' restored pages and checks
   that the K/V equal the original, that the next-token logits and a greedy
   continuation equal those from the original cache (bitwise), and that the
   next token equals a full recompute's.

Run on a GPU (the nats-py wheel carried next to it, torch + transformers
there):

    pip install --no-index nats_py-*.whl
    PYTHONPATH=python/src python3 python/examples/hf_roundtrip.py --bin .gpu --ranks 4

Off-GPU (CPU torch, the host backend, binaries from
``go build -o BIN/ ./cmd/coordinator ./cmd/rankd``):

    python3 python/examples/hf_roundtrip.py --bin BIN --ranks 4 --device host

It prints one table and exits 0 only when every check passed. --tamper R
flips one byte of rank R's restored pages before the checks (they must then
report FAIL: the checks can fail).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

# Expandable segments are not cudaMalloc blocks: legacy CUDA IPC cannot name
# them, and kvtier refuses them. Set before torch initializes CUDA.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from kvtier import client, cuda, dcp, wire

INSTANCE = "hf"
HOST_UUID = "HOST-hfroundtrip00000001"


def wait_resynced(work: pathlib.Path, ranks: int, procs: list[Any], timeout: float = 120.0) -> float:
    """Waits until the coordinator has resynced every rank, and returns
    how long that took. A coordinator with a new index asks each rankd that
    joins for its inventory, and while an inventory streams in the rank is
    hidden from lookups: a restore planned in that window finds nothing (a
    miss, recomputed; seen once as this example's failure). An operator's
    readiness check would wait the same way: kvtier_coord_resyncs_total
    {outcome="ok"} reaching the rank count on the coordinator's /metrics."""
    t0 = time.monotonic()
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a daemon exited (rc {p.returncode}) before the ranks were resynced: {p.args[0]}")
        try:
            if coord_metric(work, 'kvtier_coord_resyncs_total{outcome="ok"}') >= ranks:
                return time.monotonic() - t0
        except (OSError, RuntimeError):
            pass  # not serving yet, or no resync finished yet (the series appears with the first)
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the coordinator did not resync {ranks} ranks in {timeout:.0f} s "
                               f"(see {work / 'logs' / 'coordinator.log'})")
        time.sleep(0.05)


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


def kv_heads_of_rank(rank: int, tp: int, kv_heads: int) -> list[int]:
    """The KV heads TP rank `rank` of `tp` holds, as vLLM's QKVParallelLinear
    shards them: an even split when tp divides the heads, else (tp a
    multiple of the heads) every head replicated on tp/kv_heads consecutive
    ranks."""
    if kv_heads >= tp:
        if kv_heads % tp:
            raise SystemExit(f"FAIL: {kv_heads} KV heads cannot be split over {tp} TP ranks")
        n = kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    if tp % kv_heads:
        raise SystemExit(f"FAIL: {tp} TP ranks cannot replicate {kv_heads} KV heads evenly")
    return [rank // (tp // kv_heads)]


class TimedSession:
    """A RankSession whose retrieve records when its reply came (per-rank
    restore time inside the one restore protocol)."""

    def __init__(self, s: client.RankSession) -> None:
        self._s = s
        self.sent = 0.0
        self.done = 0.0
        self.restore_id = ""

    @property
    def rank(self) -> wire.Rank:
        return self._s.rank

    @property
    def namespace(self) -> dcp.Namespace:
        return self._s.namespace

    async def retrieve(self, items, restore_id: str = ""):
        self.sent, self.restore_id = time.perf_counter(), restore_id
        try:
            return await self._s.retrieve(items, restore_id)
        finally:
            self.done = time.perf_counter()

    async def retrieve_packed(self, items, restore_id: str, block_ids, per_chunk, **kw):
        self.sent, self.restore_id = time.perf_counter(), restore_id
        try:
            return await self._s.retrieve_packed(items, restore_id, block_ids, per_chunk, **kw)
        finally:
            self.done = time.perf_counter()


def ceiling(torch, on_gpu: bool, n: int) -> tuple[float, float]:
    """The bytes per second of one plain copy of n bytes, best of 3, for a
    store (device to host) and a restore (host to device): the copy
    engine between pinned host memory and cuda:0 on a GPU, a memmove on
    the host backend (its pools are host memory)."""
    if on_gpu:
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        pairs = ((host, dev), (dev, host))
    else:
        a, b = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        pairs = ((b, a), (a, b))
    out = []
    for dst, src in pairs:  # store: into host memory; restore: from it
        best = float("inf")
        for _ in range(3):
            if on_gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=on_gpu)
            if on_gpu:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out.append(n / best)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=".gpu", help="directory with the coordinator and rankd binaries")
    ap.add_argument("--work", default="", help="scratch directory (default: a new temp dir)")
    ap.add_argument("--ranks", type=int, default=1, help="TP size: rankds (one pool set each), all on one device")
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda",
                    help="cuda: pools on cuda:0, CUDA IPC; host: CPU torch, the host backend (no GPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64, help="128: an 8B model's pages (with --layers 32)")
    ap.add_argument("--chunks", type=int, default=32, help="full chunks in the prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--generate", type=int, default=16, help="greedy tokens compared after the restore")
    ap.add_argument("--l1-bytes", default="", help="each rankd's L1 (default 2GiB on cuda, 256MiB on host)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tamper", type=int, default=-1, help="flip one restored byte of this rank (self-test)")
    ap.add_argument("--chunks-per-store", type=int, default=0,
                    help="chunks per store request, one producer event each; default 0: every chunk in one "
                         "request per rank, as the connector stores what one forward step completed")
    ap.add_argument("--begin-reps", type=int, default=0,
                    help="after the restore, time this many more restore_begins of the whole prompt and split "
                         "each into the coordinator's share (kvtier_coord_restore_begin_seconds), the client's "
                         "plan decoding and the rest (NATS, TLS, the client's loop)")
    ap.add_argument("--restore-reps", type=int, default=1,
                    help="restores of the whole prompt, each into wiped pools and checked byte for byte; the first "
                         "(cold) is the verdict row, the median of the rest a row of its own")
    ap.add_argument("--store-reps", type=int, default=1,
                    help="stores of the whole prompt; the first (cold) is the store row, the rest store the same "
                         "pages under other keys (another first token) and their median is a row of its own")
    ap.add_argument("--settle", action="store_true",
                    help="wait for every rankd's L2 write-behind of the store before the restores")
    ap.add_argument("--timeline", action="store_true",
                    help="print each rank's stage timeline of the last restore (the rankd's status)")
    ap.add_argument("--coordinator-arg", action="append", default=[],
                    help="one more coordinator serve flag, e.g. --coordinator-arg=--cpu-profile=/tmp/c.pprof "
                         "(repeatable)")
    ap.add_argument("--rankd-arg", action="append", default=[],
                    help="one more rankd flag, e.g. --rankd-arg=--cpu-profile=/tmp/r.pprof (repeatable)")
    args = ap.parse_args()
    if args.ranks < 1:
        ap.error("--ranks must be >= 1")
    if args.restore_reps < 1:
        ap.error("--restore-reps must be >= 1")
    if args.store_reps < 1:
        ap.error("--store-reps must be >= 1")
    if args.chunks_per_store < 0:
        ap.error("--chunks-per-store must be >= 0")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --device host for the host backend)")
        return 1
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="kvtier-hf-"))
    shutil.rmtree(work, ignore_errors=True)
    for d in ("index", "l2", "logs", "shm"):
        (work / d).mkdir(mode=0o700, parents=True)  # rankd refuses an L2 / host directory others can read
    bindir = pathlib.Path(args.bin)
    l1 = args.l1_bytes or ("2GiB" if args.device == "cuda" else "256MiB")

    # ---- daemons
    nats_port, gossip = free_port(), f"127.0.0.1:{free_port()}"
    procs = []

    def start(name, argv):
        log = open(work / "logs" / f"{name}.log", "wb")  # noqa: SIM115 (lives with the process)
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    # Secure as in production: credentials for instance "hf" (TLS for 127.0.0.1).
    creds = work / "creds"
    subprocess.run([str(bindir / "coordinator"), "init", "--dir", str(creds), "--instance", INSTANCE,
                    "--tp-size", str(args.ranks), "--tls-host", "127.0.0.1"], check=True, stdout=subprocess.DEVNULL)
    start("coordinator", [str(bindir / "coordinator"), "serve", "--data-dir", str(work / "index"),
                          "--nats-host", "127.0.0.1", "--nats-port", str(nats_port), "--bind", gossip,
                          "--http", "127.0.0.1:0", "--creds-dir", str(creds), *args.coordinator_arg])
    dev_args = (["--device", "cuda:0"] if args.device == "cuda" else
                ["--device", "host", "--host-dir", str(work / "shm"), "--host-uuid", HOST_UUID])
    for r in range(args.ranks):
        start(f"rankd{r}", [str(bindir / "rankd"), "--instance", INSTANCE, "--tp-rank", str(r),
                            "--tp-size", str(args.ranks), *dev_args, "--l1-bytes", l1,
                            "--l2-dir", str(work / "l2"), "--l2-free-floor", "0",
                            "--join", gossip, "--bind", f"127.0.0.1:{free_port()}",
                            "--http", "127.0.0.1:0", "--creds-dir", str(creds),
                            *[a.replace("{rank}", str(r)) for a in args.rankd_arg]])
    try:
        took = wait_resynced(work, args.ranks, procs)
        print(f"daemons ready: {args.ranks} ranks resynced by the coordinator in {took:.2f} s")
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
    on_gpu = args.device == "cuda"
    dev = torch.device("cuda:0" if on_gpu else "cpu")
    tp = args.ranks
    bs, bpc = args.block_size, args.blocks_per_chunk
    chunk_tokens = bs * bpc
    n_prompt = args.chunks * chunk_tokens + 1  # the last token is computed, as vLLM does
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                      num_attention_heads=2 * args.kv_heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    prompt = torch.tensor([[rng.randrange(cfg.vocab_size) for _ in range(n_prompt)]], device=dev)
    P = n_prompt - 1
    kvh, hd, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    heads = [kv_heads_of_rank(r, tp, kvh) for r in range(tp)]
    rh = len(heads[0])  # KV heads per rank

    with torch.no_grad():
        out = model(input_ids=prompt[:, :P], use_cache=True)
        orig = [(k.clone(), v.clone()) for k, v in cache_layers(out.past_key_values)]
    assert orig[0][0].shape == (1, kvh, P, hd), orig[0][0].shape

    # ---- paged pools per rank, vLLM FlashInfer layout: [num_blocks, 2, bs, heads_per_rank, hd]
    n_chunks = args.chunks
    num_blocks = 2 * n_chunks * bpc + 7
    shape = (num_blocks, 2, bs, rh, hd)
    page = 2 * bs * rh * hd * 2  # bf16
    pool_bytes = num_blocks * page
    host = None if on_gpu else cuda.HostDevice(str(work / "shm"), HOST_UUID)
    host_mems: list[Any] = []

    def new_pool():
        if host is None:
            return torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        mem = host.alloc(pool_bytes)
        host_mems.append(mem)
        t = torch.frombuffer(mem.buf, dtype=torch.uint8, count=pool_bytes).view(torch.bfloat16).view(shape)
        t.zero_()
        return t

    pools = [[new_pool() for _ in range(L)] for _ in range(tp)]  # [rank][layer]
    table_a = rng.sample(range(num_blocks), n_chunks * bpc)  # the scheduler's: the same on every rank
    table_b = rng.sample(range(num_blocks), n_chunks * bpc)
    idx_a, idx_b = torch.tensor(table_a, device=dev), torch.tensor(table_b, device=dev)

    def to_pages(r: int, layer: int) -> None:
        k, v = orig[layer]
        hs = torch.tensor(heads[r], device=dev)
        kk = k[0][hs].transpose(0, 1).reshape(n_chunks * bpc, bs, rh, hd)  # [blocks, bs, rh, hd]
        vv = v[0][hs].transpose(0, 1).reshape(n_chunks * bpc, bs, rh, hd)
        pools[r][layer][idx_a, 0] = kk
        pools[r][layer][idx_a, 1] = vv

    def from_pages(layer: int):
        """The full K/V of a layer from the ranks' pages at table_b: every
        head from the first rank that holds it."""
        ks, vs = [None] * kvh, [None] * kvh
        for r in range(tp):
            kk, vv = pools[r][layer][idx_b, 0], pools[r][layer][idx_b, 1]  # [blocks, bs, rh, hd]
            for j, h in enumerate(heads[r]):
                if ks[h] is None:
                    ks[h] = kk[:, :, j].reshape(P, hd)
                    vs[h] = vv[:, :, j].reshape(P, hd)
        k = torch.stack(ks).unsqueeze(0).contiguous()
        v = torch.stack(vs).unsqueeze(0).contiguous()
        return k, v

    for r in range(tp):
        for layer in range(L):
            to_pages(r, layer)
    if on_gpu:
        torch.cuda.synchronize()
    reference = [[pools[r][layer][idx_a].clone() for layer in range(L)] for r in range(tp)]

    spec = dcp.Spec(model="hf-tiny-llama-random", cache_salt=f"seed{args.seed}",
                    layout=dcp.Layout(tp=tp, dcp=1, interleave=1, pp=1),
                    groups=[dcp.Group(name="full_attn", kind=dcp.Kind.ATTENTION, block_size=bs, layers=L,
                                      semantic_bytes=page, page_bytes=page, stride_bytes=page, kv_format="bf16")],
                    chunk_tokens=chunk_tokens)
    res = spec.resolve()
    tokens = prompt[0, :P].tolist()
    hashes = res.chunk_hashes(tokens)
    assert len(hashes) == n_chunks

    rows: list[tuple[str, str, bool]] = []
    rank_rows: list[list[str]] = []
    opts = client.ConnectOptions(servers=[f"nats://127.0.0.1:{nats_port}"], name="hf-roundtrip", timeout=60,
                                 instance=INSTANCE, creds_dir=str(work / "creds"))
    c = wait_for("NATS reachable", lambda: client.SyncClient(opts))
    nbytes = n_chunks * bpc * page * L  # per rank
    with c:
        ranks = [wire.Rank(INSTANCE, r) for r in range(tp)]
        sts = [wait_for(f"rankd {r} accepts", lambda r=r: (s := c.status(r)).accepting and s) for r in ranks]
        uuid = "GPU-" + str(torch.cuda.get_device_properties(dev).uuid) if on_gpu else HOST_UUID
        rows.append((f"{tp} rankds' device", ", ".join(sorted({f"{s.device.backend} {s.device.uuid}" for s in sts})),
                     all(s.device.uuid == uuid for s in sts)))
        c.register_spec(spec)

        sessions = []
        agree, same_raw, checked = True, 0, 0
        for r in range(tp):
            regs = []
            for layer, t in enumerate(pools[r]):
                if host is not None:
                    h = host_mems[r * L + layer].export(0, pool_bytes)
                else:
                    # Handles: torch's (parsed defensively) and the driver's must agree.
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
            sessions.append(c.register(ranks[r], spec, uuid, regs))
        if on_gpu:
            rows.append(("torch view offset/size == driver's", f"{checked}/{tp * L} pools checked, "
                         f"{same_raw} with identical handle bytes", agree and checked == tp * L))

        # Store: every rank every chunk, each store request its own
        # interprocess event recorded before the request (C1); all ranks at
        # once.
        def new_event():
            if host is not None:
                hev = host.new_event()
                hev.record()
                return hev, hev.export()
            ev = torch.cuda.Event(interprocess=True)
            ev.record(torch.cuda.current_stream())
            return ev, cuda.event_handle_from_torch(ev, uuid)

        per = args.chunks_per_store or n_chunks

        def store_all(hs: list[Any]) -> tuple[float, list[float], list[bool], int]:
            """Stores every rank's chunks under hs, all ranks at once: the
            seconds from the first request to the last reply, each rank's
            last reply (perf_counter), whether each rank stored every chunk
            and failed none, and the chunk shards stored."""
            done = [0.0] * tp
            futs: list[list[Any]] = [[] for _ in range(tp)]
            t0 = time.perf_counter()
            for c0 in range(0, n_chunks, per):
                cbs = [wire.ChunkBlocks(hs[ci], [table_a[ci * bpc:(ci + 1) * bpc]])
                       for ci in range(c0, min(c0 + per, n_chunks))]
                for r in range(tp):
                    ev, eh = new_event()
                    f = sessions[r].store_async("hf-prompt", cbs, eh)

                    def stamp(_f, r=r):
                        done[r] = max(done[r], time.perf_counter())

                    f.add_done_callback(stamp)
                    futs[r].append((ev, f))
            replies = [[f.result(120) for _, f in futs[r]] for r in range(tp)]
            took = time.perf_counter() - t0
            for r in range(tp):
                for ev, _ in futs[r]:  # events live until their store answered
                    rel = getattr(ev, "release", None)
                    if callable(rel):
                        rel()
            ok = [sum(x.stored for x in replies[r]) == n_chunks
                  and not any(x.failed or x.blocks_in_use for x in replies[r]) for r in range(tp)]
            return took, [d - t0 for d in done], ok, sum(sum(x.stored for x in rep) for rep in replies)

        st_stages0 = [rankd_stage_sums(work, r, "store") for r in range(tp)]
        store_all_s, store_done, ok_store, stored_n = store_all(hashes)
        for r in range(tp):
            print(f"  store 1 rank {r}: {store_all_s * 1e3:.2f} ms all ranks; in the rankd: "
                  + stage_deltas(st_stages0[r], rankd_stage_sums(work, r, "store")))
        ce_store, ce_restore = ceiling(torch, on_gpu, tp * nbytes)
        rows.append(("store (all ranks)", f"{stored_n}/{tp * n_chunks} "
                     f"chunk shards in {-(-n_chunks // per)} requests per rank, {tp * nbytes} B, "
                     f"{tp * nbytes / store_all_s / 1e9:.2f} GB/s = {tp * nbytes / store_all_s / ce_store:.3f} of "
                     f"the ceiling", all(ok_store)))
        # --store-reps: the same pages stored again under other keys (the
        # prompt with another first token: every chunk's hash differs), so
        # that each is a whole store and not the rankd finding its keys
        # held; the first store of a process is cold (the pools' IPC
        # mappings opened, the code's first pass).
        warm_st: list[float] = []
        warm_st_ok = True
        for rep in range(1, args.store_reps):
            alt = list(tokens)
            alt[0] = (alt[0] + rep) % cfg.vocab_size
            stages0 = [rankd_stage_sums(work, r, "store") for r in range(tp)]
            took, _, ok, n = store_all(res.chunk_hashes(alt))
            warm_st.append(took)
            warm_st_ok = warm_st_ok and all(ok) and n == tp * n_chunks
            for r in range(tp):
                print(f"  store {rep + 1} rank {r}: {took * 1e3:.2f} ms all ranks; in the rankd: "
                      + stage_deltas(stages0[r], rankd_stage_sums(work, r, "store")))
        if warm_st:
            rows.append(warm_row("stores", args.store_reps, warm_st, tp * nbytes, ce_store,
                                 "first request to last reply", "the same pages under other keys", warm_st_ok))

        wait_for("lookup covers the prompt",
                 lambda: c.lookup(res.namespace, hashes, instance=INSTANCE).prefix == n_chunks)
        if args.settle:
            # The store's L2 write-behind (checksums, writes, fsyncs) takes
            # the rankd's CPU for a while after the store's reply; without
            # this, the restores below share the rankd with it.
            t_settle = time.perf_counter()
            for r in range(tp):
                wait_for(f"rankd {r}'s L2 write-behind", lambda r=r: rankd_metric(work, r, "kvtier_transfer_l2_objects")
                         >= n_chunks, timeout=300)
            print(f"  L2 write-behind of every rank done {time.perf_counter() - t_settle:.2f} s after the lookup")

        # Wipe and restore into another block table: one restore, every
        # rank retrieving its own shard; --restore-reps more than one
        # repeats it (the first restore of a process is cold: the client's
        # and the daemons' first pass through the code, the buffers'
        # growth), every repetition checked byte for byte.
        ranked = [str(ranks[r]) for r in range(tp)]
        same = [True] * tp
        warm: list[float] = []
        warm_complete = True
        for rep in range(args.restore_reps):
            for pr in pools:
                for p in pr:
                    p.zero_()
            if on_gpu:
                torch.cuda.synchronize()
            timed = {ranked[r]: TimedSession(sessions[r].aio) for r in range(tp)}
            stages0 = [rankd_stage_sums(work, r) for r in range(tp)]
            t_restore = time.perf_counter()
            outcome = c.run(client.restore(c.aio, timed, hashes,  # type: ignore[arg-type]
                                           client.BlockTable([table_b], [bpc]),  # the items stay packed
                                           instance=INSTANCE, deadline_ms=30000))
            restore_all = time.perf_counter() - t_restore
            v = outcome.verdict
            complete = outcome.loaded == n_chunks and v is not None and v.state == wire.VERDICT_COMPLETE
            if on_gpu:
                torch.cuda.synchronize()
            if rep == args.restore_reps - 1 and 0 <= args.tamper < tp:
                pools[args.tamper][L - 1].view(torch.int16)[table_b[-1], 1, bs - 1, rh - 1, hd - 1] ^= 1  # one bit
            for r in range(tp):
                same[r] = same[r] and all(
                    torch.equal(pools[r][layer][idx_b].view(torch.int16), reference[r][layer].view(torch.int16))
                    for layer in range(L))
                tr = timed[ranked[r]]
                sent = (f"sent {(tr.sent - t_restore) * 1e3:.2f} ms after the begin, reply "
                        f"{(tr.done - tr.sent) * 1e3:.2f} ms after" if tr.sent else "not sent (no plan for this rank)")
                print(f"  restore {rep + 1} rank {r} retrieve: {sent}; in the rankd: "
                      + stage_deltas(stages0[r], rankd_stage_sums(work, r)))
            if rep == 0:
                rows.append(("restore verdict (all ranks)", f"{v.state if v else 'none'}, {outcome.loaded}/"
                             f"{n_chunks} chunks, {tp * nbytes} B, {tp * nbytes / restore_all / 1e9:.2f} GB/s begin "
                             f"to verdict = {tp * nbytes / restore_all / ce_restore:.3f} of the ceiling"
                             f"{', ' + outcome.problem if outcome.problem else ''}", complete))
                for r in range(tp):
                    st_s = max(store_done[r], 1e-9)  # common start to the rank's last store reply
                    re_s = max(timed[ranked[r]].done - t_restore, 1e-9)  # restore begin to the rank's reply
                    rank_rows.append([str(r), ",".join(map(str, heads[r])), str(nbytes), f"{nbytes / st_s / 1e9:.2f}",
                                      f"{nbytes / re_s / 1e9:.2f}", "ok" if ok_store[r] else "FAIL"])
            else:
                warm.append(restore_all)
                warm_complete = warm_complete and complete
                if not complete:
                    rows.append((f"restore {rep + 1} verdict", f"{v.state if v else 'none'}, {outcome.loaded}/"
                                 f"{n_chunks} chunks{', ' + outcome.problem if outcome.problem else ''}", False))
        for r in range(tp):
            rank_rows[r][-1] = "ok" if same[r] and rank_rows[r][-1] == "ok" else "FAIL"
            if args.timeline and timed[ranked[r]].restore_id:
                print_timeline(c, ranks[r], timed[ranked[r]].restore_id, f"rank {r}, restore {args.restore_reps}")
        if warm:
            rows.append(warm_row("restores", args.restore_reps, warm, tp * nbytes, ce_restore, "begin to verdict",
                                 "pages checked after each (table below)", warm_complete))
        if args.begin_reps > 0:
            rows.append(begin_breakdown(c, res.namespace, hashes, args.begin_reps, work))
        for s in sessions:
            s.release()
    kind = "copy engine: pinned host memory <-> cuda:0" if on_gpu else "memmove"
    rows.append(("ceiling (one plain copy of every rank's bytes)", f"store {ce_store / 1e9:.2f} GB/s, restore "
                 f"{ce_restore / 1e9:.2f} GB/s ({kind}, best of 3, this run)", True))

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

        restored_pairs = [from_pages(layer) for layer in range(L)]
        same_kv = all(torch.equal(k0, k1) and torch.equal(v0, v1)
                      for (k0, v0), (k1, v1) in zip(orig, restored_pairs, strict=True))
        rows.append(("restored K/V == original K/V", f"{L} layers x {kvh} heads x {P} tokens", same_kv))
        lo_orig, toks_orig = continue_from([(k.clone(), v.clone()) for k, v in orig])
        lo_rest, toks_rest = continue_from(restored_pairs)
        rows.append(("next-token logits (restored vs original cache)", "bitwise", torch.equal(lo_orig, lo_rest)))
        rows.append((f"greedy {args.generate} tokens (restored vs original)", str(toks_rest[:8]) + "...",
                     toks_orig == toks_rest))
        full = model(input_ids=prompt, use_cache=False).logits[:, -1].float()
        diff = (full - lo_rest).abs().max().item()
        rows.append(("next token vs full recompute", f"max |dlogit| {diff:.3g}",
                     int(full.argmax()) == int(lo_rest.argmax())))

    print(f"\nkvtier HF round trip: Llama {L} layers, {kvh} KV heads, TP{tp} ({rh} heads per rank), "
          f"{n_prompt}-token prompt, chunk {chunk_tokens} tokens, page {page} B, {args.device}, work dir {work}")
    hdr = ["rank", "KV heads", "bytes", "store GB/s", "restore GB/s", "pages == stored"]
    w = [max(len(hdr[i]), *(len(x[i]) for x in rank_rows)) for i in range(len(hdr))]
    print("  " + "  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
    for x in rank_rows:
        print("  " + "  ".join(s.ljust(w[i]) for i, s in enumerate(x)))
    print("  (per rank: store from the first request to the rank's last reply; restore from the begin to the "
          "rank's retrieve reply, its pages copied and checksummed)")
    w0 = max(len(a) for a, _, _ in rows)
    for a, b, ok in rows:
        print(f"  {a:<{w0}}  {'ok  ' if ok else 'FAIL'}  {b}")
    ok = all(ok for _, _, ok in rows) and all(x[-1] == "ok" for x in rank_rows)
    print("RESULT", "ok" if ok else "FAIL")
    return 0 if ok else 1


def warm_row(what: str, reps: int, times: list[float], nbytes: int, ceiling: float, span: str, tail: str,
             ok: bool) -> tuple[str, str, bool]:
    """The result row of repetitions 2..reps of a store or restore of
    nbytes: their median rate over span, as a fraction of the ceiling
    (bytes/s), and the best."""
    med = statistics.median(times)
    return (f"{what} 2-{reps}, warm (median)", f"{nbytes / med / 1e9:.2f} GB/s {span} = {nbytes / med / ceiling:.3f} "
            f"of the ceiling (best {nbytes / min(times) / ceiling:.3f}); {tail}", ok)


def metrics_text(log: pathlib.Path) -> str:
    """The /metrics page of the daemon whose log this is (its HTTP address
    from the log)."""
    m = re.search(r'"http":\s*"([^"]+)"', log.read_text(errors="replace"))
    if m is None:
        raise RuntimeError(f"{log.name}: no HTTP address logged")
    with urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10) as r:
        return str(r.read().decode())


def rankd_stage_sums(work: pathlib.Path, rank: int, op: str = "retrieve") -> dict[str, float]:
    """A rankd's stage totals of op (retrieve or store) so far
    (kvtier_rankd_stage_seconds' sums by stage), its op's requests' receipt-to-reply total
    ("request"), its CPU time ("cpu"), its garbage collections ("gcs") and
    its device transfers by copy path ("scatters sm-staged": counts)."""
    out: dict[str, float] = {}
    for line in metrics_text(work / "logs" / f"rankd{rank}.log").splitlines():
        if line.startswith("kvtier_rankd_stage_seconds_sum{") and f'op="{op}"' in line:
            m = re.search(r'stage="([^"]+)"', line)
            if m:
                out[m.group(1)] = float(line.split()[-1])
        elif line.startswith("kvtier_rankd_engine_request_seconds_sum{") and f'op="{op}"' in line:
            out["request"] = float(line.split()[-1])
        elif line.startswith("process_cpu_seconds_total "):
            out["cpu"] = float(line.split()[-1])
        elif line.startswith("go_gc_duration_seconds_count "):
            out["gcs"] = float(line.split()[-1])
        elif line.startswith("kvtier_transfer_device_transfers_total{"):
            m = re.search(r'op="([^"]+)".*path="([^"]+)"', line)  # labels come sorted
            if m:
                out[f"{m.group(1)}s {m.group(2)}"] = float(line.split()[-1])
    return out


def rankd_metric(work: pathlib.Path, rank: int, name: str) -> float:
    """One unlabelled-but-for-the-rank value of a rankd's /metrics (0 when absent)."""
    for line in metrics_text(work / "logs" / f"rankd{rank}.log").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def stage_deltas(before: dict[str, float], after: dict[str, float]) -> str:
    """What changed between two rankd_stage_sums: the stages that took time,
    in ms (stages of several copy batches are their sum, so they overlap),
    the CPU time in ms (the process's clock ticks: 10 ms steps) and the
    garbage collections, a count (0 is printed too)."""
    parts = []
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if k == "gcs":
            parts.append(f"gcs {d:.0f}")
        elif k.startswith(("gathers ", "scatters ")):
            if d > 0:
                parts.append(f"{k} {d:.0f}")
        elif d >= 5e-6:
            parts.append(f"{k} {d * 1e3:.2f}")
    return " ".join(parts) or "none"


def print_timeline(c: Any, rank: wire.Rank, restore_id: str, label: str) -> None:
    """Prints the rankd's stage timeline of one retrieve (its status
    request's Timelines): the request's own stages, then per copy batch the
    host's stages and the device's scatter, in ms from the receipt."""
    raw = c.run(c.aio.call(c.aio.subjects.engine(rank, wire.OP_STATUS), {"timelines": restore_id}, dict,
                           decoder=lambda data, _subject: json.loads(data)["ok"]))
    tls = [t for t in raw.get("timelines") or [] if t.get("op") == "retrieve"]
    if not tls:
        print(f"  timeline {label}: none kept")
        return
    t = tls[-1]
    by: dict[int, list[str]] = {}
    for st in t["stages"]:
        at, dur = st["start_ns"] / 1e6, st["dur_ns"] / 1e6
        name = st["name"] + ("(dev)" if st.get("device") else "")
        by.setdefault(st["batch"], []).append(f"{name} {at:.2f}+{dur:.2f}")
    print(f"  timeline {label}: {t['dur_ns'] / 1e6:.2f} ms receipt to reply, {t['bytes']} B, {len(by) - (-1 in by)} "
          f"batches{', truncated' if t.get('truncated') else ''} (stage start+duration, ms from the receipt)")
    for b in sorted(by):
        print(f"    {'request' if b < 0 else f'batch {b}'}: " + ", ".join(by[b]))


def coord_metric(work: pathlib.Path, name: str) -> float:
    """One value of the coordinator's /metrics (its HTTP address from its
    log): a counter, or a histogram's _sum / _count line."""
    for line in metrics_text(work / "logs" / "coordinator.log").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"no {name} in the coordinator's metrics")


def begin_breakdown(c: Any, ns: dcp.Namespace, hashes: list[Any], reps: int,
                    work: pathlib.Path) -> tuple[str, str, bool]:
    """reps restore_begins of the whole prompt as the restore sends them
    (restore_begin_packed: the plan's items kept packed), timed in the
    client, with the coordinator's handler time (its histogram's sum and
    count around them) and the client's plan decoding
    (client_plan.decode_plan_packed_reply timed in place): medians of the
    client's, means of the coordinator's."""
    import statistics

    from kvtier import client_plan

    decode = client_plan.decode_plan_packed_reply
    spent: list[float] = []

    def timed_decode(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return decode(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t)

    client_plan.decode_plan_packed_reply = timed_decode  # type: ignore[assignment]
    try:
        s0 = coord_metric(work, "kvtier_coord_restore_begin_seconds_sum")
        n0 = coord_metric(work, "kvtier_coord_restore_begin_seconds_count")
        total = []
        for _ in range(reps):
            t = time.perf_counter()
            c.run(c.aio.restore_begin_packed(ns, hashes, instance=INSTANCE, deadline_ms=1))
            total.append(time.perf_counter() - t)
        s1 = coord_metric(work, "kvtier_coord_restore_begin_seconds_sum")
        n1 = coord_metric(work, "kvtier_coord_restore_begin_seconds_count")
    finally:
        client_plan.decode_plan_packed_reply = decode  # type: ignore[assignment]
    coord = (s1 - s0) / max(n1 - n0, 1)
    med, dec = statistics.median(total), statistics.median(spent)
    return (f"restore_begin of {len(hashes)} chunks x {reps}",
            f"client {med * 1e3:.2f} ms median = coordinator {coord * 1e3:.2f} ms (mean of {int(n1 - n0)}) + plan "
            f"decoding {dec * 1e3:.2f} ms + NATS, TLS and the client's loop {(med - coord - dec) * 1e3:.2f} ms",
            n1 - n0 == reps)


if __name__ == "__main__":
    # A bound (timeout(1), gpu-pending.sh's steps) ends the run with
    # SIGTERM: leave through main's clean-up, which stops the daemons,
    # instead of leaving them on the GPU for the next step.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    sys.exit(main())
