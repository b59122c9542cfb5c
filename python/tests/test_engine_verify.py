"""Engine-side verification (kvtier_verify_on_engine, issue 28): kvsum64
computed from vLLM's KV tensors against Go's vectors and Go's packing
(checksum/testdata/packed_object.json), and the connector failing the
chunks a lying rankd reported placed.

The reference (plain Python) tests run everywhere; the torch ones need
torch, which the plain test venv does not have: ``make test-vllm`` runs
them in the vLLM venv (``.venv-vllm/bin/pytest tests/test_engine_verify.py``)."""

from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

import fakes
from kvtier import _codec, _kvsum_torch, client_plan, cuda, dcp, wire
from kvtier.vllm import KvtierConnectorMetadata, LoadSpec, spec_from_vllm
from kvtier.vllm._verify import engine_pools
from kvtier.vllm.connector import KVConnectorRole, KvtierConnector

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKED = json.loads((ROOT / "checksum" / "testdata" / "packed_object.json").read_text())


def go_vectors() -> list[tuple[int, int]]:
    """checksum.Vectors, read from the Go source."""
    src = (ROOT / "checksum" / "vectors.go").read_text()
    out = [(int(n), int(s, 16)) for n, s in re.findall(r"\{(\d+), 0x([0-9a-fA-F]+)\}", src)]
    assert len(out) >= 10, "checksum/vectors.go: the vectors were not found"
    return out


def vector_input(n: int) -> bytes:
    return bytes((k * 7 + 3) & 0xFF for k in range(n))


def fill(g: int, p: int, size: int) -> bytes:
    """The golden pools' bytes (the Go test's packedFill)."""
    return bytes((o * 7 + (o >> 8) * 13 + p * 31 + g * 101 + 3) & 0xFF for o in range(size))


def golden_kv_config() -> fakes.KVCacheConfig:
    """The vLLM config whose kv_split spec the Go golden vector packs."""
    attn = fakes.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=fakes.BF16)
    mla = fakes.MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=25, dtype=fakes.FP8)
    return fakes.KVCacheConfig(PACKED["num_blocks"], [], [fakes.KVCacheGroupSpec(["a0", "a1"], attn),
                                                          fakes.KVCacheGroupSpec(["m0", "m1", "m2"], mla)])


def golden_spec():
    return spec_from_vllm(golden_kv_config(), "golden-pack", "", tp=1, dcp_size=1, pp=1, chunk_tokens=16,
                          layout="kv_split")


# ------------------------------------------------------------------ reference


@pytest.mark.parametrize("n, want", go_vectors())
def test_reference_matches_go_vectors(n, want):
    assert _kvsum_torch.kvsum64_ref(vector_input(n)) == want


def test_golden_spec_is_the_connectors():
    """The Go golden vector packs the spec the connector derives from the
    vLLM config, with the pool bytes this file builds."""
    spec, _ = golden_spec()
    assert spec == _codec.from_obj(dcp.Spec, PACKED["spec"], "spec")
    assert PACKED["fill"] == "(o*7 + (o>>8)*13 + p*31 + g*101 + 3) mod 256"


def test_reference_packing_matches_go():
    spec, _ = golden_spec()
    r = spec.resolve()
    n = PACKED["num_blocks"]
    for obj in PACKED["objects"]:
        g = r.spec.groups[obj["group"]]
        pools = [fill(obj["group"], p, n * g.page_bytes) for p in range(g.layers)]
        packed = _kvsum_torch.pack_ref(pools, obj["blocks"], g.page_bytes)
        assert len(packed) == obj["size"]
        assert _kvsum_torch.kvsum64_ref(packed) == int(obj["sum"], 16), obj


# ------------------------------------------------------------------ torch


@pytest.mark.parametrize("n, want", go_vectors())
def test_torch_matches_go_vectors(n, want):
    torch = pytest.importorskip("torch")
    data = torch.tensor(list(vector_input(n)), dtype=torch.uint8)
    assert _kvsum_torch.kvsum64(data) == want


def golden_caches(torch):
    """vLLM's tensors of the golden config: K/V split (2, blocks, ...) for
    the attention layers, block-major for MLA, bytes as the Go test's."""
    n = PACKED["num_blocks"]
    caches = {}
    for li in range(2):
        t = torch.empty((2, n, 4, 1, 8), dtype=torch.bfloat16)
        u8 = t.view(-1).view(torch.uint8)
        half = u8.numel() // 2
        u8[:half] = torch.tensor(list(fill(0, 2 * li, half)), dtype=torch.uint8)
        u8[half:] = torch.tensor(list(fill(0, 2 * li + 1, half)), dtype=torch.uint8)
        caches[f"a{li}"] = t
    for li in range(3):
        t = torch.empty((n, 4, 1, 25), dtype=torch.float8_e4m3fn)
        t.view(-1).view(torch.uint8).copy_(torch.tensor(list(fill(1, li, n * 100)), dtype=torch.uint8))
        caches[f"m{li}"] = t
    return caches


@pytest.mark.parametrize("max_batch_bytes", [1 << 20, 1024, 1])
def test_torch_packing_from_vllm_tensors_matches_go(max_batch_bytes):
    """The connector's view of vLLM's tensors (engine_pools) and the torch
    sums reproduce the rankd's packed objects' sums: the aligned path (64 B
    K/V halves) and the gathered one (100 B MLA pages), several objects in
    one batch, two pools' pages of two objects per batch, and one pool's
    pages of one object per batch."""
    torch = pytest.importorskip("torch")
    _, layers = golden_spec()
    pools = engine_pools(layers, golden_caches(torch))
    assert [len(p) for p in pools] == [4, 3]
    for gi in range(2):
        objs = [o for o in PACKED["objects"] if o["group"] == gi]
        blocks = torch.tensor([o["blocks"] for o in objs], dtype=torch.int64)
        got = _kvsum_torch.object_sums(pools[gi], blocks, max_batch_bytes=max_batch_bytes)
        assert got == [int(o["sum"], 16) for o in objs]


def test_mamba_pool_is_its_whole_pages():
    """A Mamba layer's tensor holds each block's state in the first bytes
    of a padded page (rows a page apart): its pool is the whole pages, as
    the worker registers it, padding included."""
    torch = pytest.importorskip("torch")
    from kvtier.vllm.spec import GroupLayers

    n, page, state = 6, 40, 28
    raw = torch.randint(0, 256, (n * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    t = raw.view(n, page)[:, :state].view(n, 1, 1, state)  # vLLM's (num_blocks, 1, 1, state bytes)
    (pools,) = engine_pools([GroupLayers(("mamba0",), 16, page, recurrent=True)], {"mamba0": t})
    got = _kvsum_torch.object_sums(pools, torch.tensor([[4], [1]]))
    assert got == [_kvsum_torch.kvsum64_ref(bytes(raw[b * page:(b + 1) * page].tolist())) for b in (4, 1)]


# ------------------------------------------------------------------ the connector

NUM_BLOCKS = 32
BLOCK_IDS = [3, 9, 14, 5, 20, 7]  # the request's blocks; the plan covers request chunks 1..3


def verify_worker(torch, world, layout: str, verify: bool, kv_cfg=None, device: str = "cpu", **more):
    """A worker over fakes whose pools are real tensors of random bytes
    (the engine's KV) on device, one 16-token block per chunk."""
    kv_cfg = kv_cfg or fakes.attention_config(num_blocks=NUM_BLOCKS)

    class Conn(KvtierConnector):
        def _make_client(self):
            return fakes.FakeSyncClient(world)

        def _tp_rank(self):
            return 0

        def _pool_handles(self, gi, layer, tensor):
            self._check_layout(gi, layer, tensor)
            n = 2 if self.layers[gi].kv_split else 1
            return [cuda.MemHandle("host", "HOST-t", b"pool", j << 20, 1024) for j in range(n)]

    extra = {"kvtier_device": "host", "kvtier_creds_dir": "/etc/kvtier/creds", "kvtier_load_async": False,
             "kvtier_attach_wait_s": 0, "kvtier_chunk_tokens": 16, "kvtier_pool_layout": layout,
             "kvtier_verify_on_engine": verify, **more}
    w = Conn(fakes.vllm_config(1, **extra), KVConnectorRole.WORKER, kv_cfg)
    gen = torch.Generator().manual_seed(7)
    caches = {}
    for name in [n for g in kv_cfg.kv_cache_groups for n in g.layer_names]:
        shape = (NUM_BLOCKS, 2, 16, 2, 8) if layout == "block_major" else (2, NUM_BLOCKS, 16, 2, 8)
        t = torch.empty(shape, dtype=torch.bfloat16)
        u8 = t.view(-1).view(torch.uint8)
        u8.copy_(torch.randint(0, 256, (u8.numel(),), dtype=torch.uint8, generator=gen))
        caches[name] = t.to(device)
    w.register_kv_caches(caches)
    assert w.wait_attached(5), w._link.why
    return w, caches


def recorded_sum(torch, caches, layout: str, block: int) -> int:
    """What the rankd recorded for the object of one block: its pages,
    layer by layer (K then V under kv_split), summed by the reference."""
    pages = []
    for t in caches.values():
        halves = [t] if layout == "block_major" else [t[0], t[1]]
        for h in halves:
            pages.append(bytes(h[block].reshape(-1).view(torch.uint8).tolist()))
    return _kvsum_torch.kvsum64_ref(b"".join(pages))


def verified_load(torch, w, caches, layout: str, sums=None) -> LoadSpec:
    first, n = 1, 3
    items = [wire.RetrieveItem(
        chunk=c, group=0, key=dcp.Key(w.resolved.namespace, dcp.ChunkHash(bytes([c]) * 16)),
        sum=recorded_sum(torch, caches, layout, BLOCK_IDS[first + c]) if sums is None else sums[c],
        source=wire.Source(wire.Rank("engine0", 0), wire.Tier.L1)) for c in range(n)]
    raw = client_plan.PlanItems.of(items).to_bytes()
    return LoadSpec("r1", "r-1", first, n, n, {"engine0/0": raw}, [list(BLOCK_IDS)], async_load=False)


def run_load(w, load, world, on_retrieve=None, monkeypatch=None):
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, load.chunks)
    if on_retrieve is not None:
        orig = fakes.FakeSession.retrieve

        async def lying(self, items, restore_id="", timeout=None, deadline=None):
            on_retrieve()  # places a wrong byte, then reports every item OK
            return await orig(self, items, restore_id, timeout, deadline)

        monkeypatch.setattr(fakes.FakeSession, "retrieve", lying)
    w.bind_connector_metadata(KvtierConnectorMetadata([load], []))
    w.start_load_kv(None)
    errs = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return errs


@pytest.mark.parametrize("layout", ["block_major", "kv_split"])
@pytest.mark.parametrize("verify", [True, False])
def test_lying_rankd_fails_its_chunk_only_with_verification(layout, verify, monkeypatch):
    """A rankd reports every item placed and the verdict is COMPLETE, but
    one byte of the V half of the last layer's page of the plan's chunk 1
    differs from what was stored: with kvtier_verify_on_engine the worker
    finds it and recomputes chunks 1 and 2 (the chunks from the first bad
    one on); without it the lie reaches vLLM."""
    torch = pytest.importorskip("torch")
    world = fakes.FakeWorld()
    w, caches = verify_worker(torch, world, layout, verify)
    load = verified_load(torch, w, caches, layout)
    last = list(caches.values())[-1]
    page = last[BLOCK_IDS[2]] if layout == "block_major" else last[1][BLOCK_IDS[2]]

    def corrupt():
        u8 = page.reshape(-1).view(torch.uint8)
        u8[-1] ^= 0x40

    errs = run_load(w, load, world, corrupt, monkeypatch)
    if not verify:
        assert errs == set() and w.stats["loaded_tokens"] == 48
        return
    assert errs == {BLOCK_IDS[2], BLOCK_IDS[3]}
    assert w.stats["engine_verify_failures"] == 1
    assert (w.stats["loaded_tokens"], w.stats["load_failed_tokens"]) == (16, 32)
    assert w.stats["recomputed_bad_bytes_tokens"] == 16 and w.stats["restore_failures"] == 1
    assert w.recent_loads[-1]["problem"].startswith("engine verify: chunk 1 group 0 on engine0/0")


@pytest.mark.parametrize("layout", ["block_major", "kv_split"])
def test_honest_restore_passes_verification(layout):
    torch = pytest.importorskip("torch")
    world = fakes.FakeWorld()
    w, caches = verify_worker(torch, world, layout, True)
    assert run_load(w, verified_load(torch, w, caches, layout), world) == set()
    assert w.stats["loaded_tokens"] == 48 and w.stats["engine_verify_failures"] == 0


def test_no_recorded_sum_is_never_confirmed():
    """An item without a recorded sum (0) cannot be checked: under the
    option its chunk is recomputed, not trusted."""
    torch = pytest.importorskip("torch")
    world = fakes.FakeWorld()
    w, caches = verify_worker(torch, world, "block_major", True)
    sums = [recorded_sum(torch, caches, "block_major", BLOCK_IDS[1 + c]) for c in range(3)]
    sums[2] = 0
    assert run_load(w, verified_load(torch, w, caches, "block_major", sums), world) == {BLOCK_IDS[3]}
    assert w.stats["engine_verify_failures"] == 1 and w.stats["loaded_tokens"] == 32


def test_option_parses_and_defaults_off():
    from kvtier.vllm.connector import Config

    assert Config.of(fakes.vllm_config(kvtier_creds_dir="/c")).verify_on_engine is False
    assert Config.of(fakes.vllm_config(kvtier_creds_dir="/c", kvtier_verify_on_engine="true")).verify_on_engine
    with pytest.raises(ValueError, match="not a boolean"):
        Config.of(fakes.vllm_config(kvtier_creds_dir="/c", kvtier_verify_on_engine="maybe"))


def test_lying_rankd_with_several_groups_fails_the_request():
    """With two KV cache groups a failed chunk fails the whole request
    (failed_recving, vLLM recomputes it), as a failed verdict does: here
    the rankd reported group 1's page of the plan's last chunk placed, and
    it differs."""
    torch = pytest.importorskip("torch")
    spec = fakes.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=fakes.BF16)
    kv_cfg = fakes.KVCacheConfig(NUM_BLOCKS, [], [fakes.KVCacheGroupSpec(["a0", "a1"], spec),
                                                  fakes.KVCacheGroupSpec(["b0"], spec)])
    world = fakes.FakeWorld()
    w, caches = verify_worker(torch, world, "block_major", True, kv_cfg, kvtier_load_async=True)
    ids = [list(BLOCK_IDS), [b + 1 for b in BLOCK_IDS]]
    layers = [["a0", "a1"], ["b0"]]
    items = [wire.RetrieveItem(
        chunk=c, group=g, key=dcp.Key(w.resolved.namespace, dcp.ChunkHash(bytes([c]) * 16), 0, g),
        sum=recorded_sum(torch, {n: caches[n] for n in layers[g]}, "block_major", ids[g][1 + c]),
        source=wire.Source(wire.Rank("engine0", 0), wire.Tier.L1)) for c in range(3) for g in range(2)]
    raw = client_plan.PlanItems.of(items).to_bytes()
    load = LoadSpec("r1", "r-1", 1, 3, 3, {"engine0/0": raw}, ids, async_load=True)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, 3)
    caches["b0"][ids[1][3]].reshape(-1).view(torch.uint8)[0] ^= 1  # the rankd "placed" a wrong byte
    w.bind_connector_metadata(KvtierConnectorMetadata([load], []))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    deadline = time.monotonic() + 5
    while not w._loading["r1"].fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    res = w.get_transfer_results(set())
    assert res.finished_recving == {"r1"} and res.failed_recving == {"r1"}
    assert w.stats["engine_verify_failures"] == 1 and w.stats["loaded_tokens"] == 0
    assert w.recent_loads[-1]["problem"].startswith("engine verify: chunk 2 group 1")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_check_runs_in_the_loads_future_off_the_step(device, monkeypatch):
    """C11: the pages are summed in the load's future, once its verdict is
    in and before it resolves, on a thread that is neither vLLM's step nor
    the client's loop (on CUDA, on a stream that is not the step's);
    get_finished on the step only applies what was found, with the same
    outcome and counts as a check on the step. Red when the check runs in
    _settle: nothing was summed when the future resolved."""
    import dataclasses
    import threading

    from kvtier.vllm import _verify

    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    world = fakes.FakeWorld()
    w, caches = verify_worker(torch, world, "block_major", True, device=device, kvtier_load_async=True)
    step_stream = torch.cuda.current_stream() if device == "cuda" else None
    streams: list[object] = []
    load = dataclasses.replace(verified_load(torch, w, caches, "block_major"), async_load=True)
    list(caches.values())[-1][BLOCK_IDS[2]].reshape(-1).view(torch.uint8)[-1] ^= 0x40  # placed wrong
    threads: list[threading.Thread] = []
    orig = _verify.mismatches

    def spy(*a, **k):
        threads.append(threading.current_thread())
        if device == "cuda":
            streams.append(torch.cuda.current_stream())
        return orig(*a, **k)

    monkeypatch.setattr(_verify, "mismatches", spy)
    world.verdict = wire.RestoreVerdict("r-1", wire.VERDICT_COMPLETE, load.chunks)
    w.bind_connector_metadata(KvtierConnectorMetadata([load], []))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    w._loading["r1"].fut.result(5)
    assert len(threads) == 1, "the load's future resolved before its pages were summed"
    assert threads[0] is not threading.current_thread() and threads[0] is not w._client_now()._thread
    if device == "cuda":
        assert streams[0] != step_stream and streams[0] != torch.cuda.default_stream()
    assert w.get_transfer_results(set()).finished_recving == {"r1"}
    assert len(threads) == 1  # the step summed nothing
    assert w.get_block_ids_with_load_errors() == {BLOCK_IDS[2], BLOCK_IDS[3]}
    assert w.stats["engine_verify_failures"] == 1 and w.stats["recomputed_bad_bytes_tokens"] == 16
    assert w.recent_loads[-1]["problem"].startswith("engine verify: chunk 1 group 0 on engine0/0")
