"""A failed restore's verdict, as the connector reports it with several KV
cache groups (issue 27): the load's problem and log name every group that
failed, and wrong bytes in any group are counted, not only those of the
group the verdict's first reason names."""

from __future__ import annotations

from test_vllm_hybrid import BS, hybrid_worker, load, run_step

import fakes
from kvtier import wire


def test_a_chunk_failed_in_two_groups_names_both_and_counts_wrong_bytes():
    world = fakes.FakeWorld()
    w = hybrid_worker(world)
    # Chunk 1: group 0's object was missing (the first reason, the one
    # reasons[] carries), group 1's was corrupt.
    world.verdict = wire.RestoreVerdict(
        "r-1", wire.VERDICT_FAILED, 2, [1], ["chunk 1: rank 0 group 0 shard 0: missing"],
        [["rank 0 group 0 shard 0: missing", "rank 0 group 1 shard 0: corrupt"]])
    out, _ = run_step(w, loads=[load(w, [[5, 6, 7], [30, 31, 32]])])
    assert out.failed_recving == {"r1"}
    assert w.recent_loads[-1]["problem"] == ("verdict failed: chunk 1: rank 0 group 0 shard 0: missing; "
                                             "rank 0 group 1 shard 0: corrupt")
    assert w.stats["recomputed_bad_bytes_tokens"] == BS  # the corrupt group's chunk
