"""python/examples/hf_roundtrip.py (the H200 harness) off-GPU: CPU torch,
the host backend, 4 TP rankds, a tiny random Llama. It must pass, and fail
when one restored bit of one rank is flipped (--tamper). Needs torch and
transformers: run by `make test-vllm` (python/.venv-vllm)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from cluster import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

SCRIPT = REPO / "python" / "examples" / "hf_roundtrip.py"


def roundtrip(binaries: pathlib.Path, work: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--bin", str(binaries), "--work", str(work), "--ranks", "4",
                           "--device", "host", "--chunks", "4", "--layers", "2", "--generate", "4", *extra],
                          capture_output=True, text=True, timeout=600)


def rank_rows(out: str) -> list[list[str]]:
    """The per-rank table: rank, KV heads, bytes, store, restore, verdict."""
    rows = [line.split() for line in out.splitlines()]
    return [r for r in rows if len(r) == 6 and r[0].isdigit() and "," in r[1]]


def test_four_rank_roundtrip_on_the_host_backend(binaries: pathlib.Path, tmp_path: pathlib.Path) -> None:
    p = roundtrip(binaries, tmp_path / "ok", "--restore-reps", "2", "--store-reps", "2", "--settle", "--timeline")
    assert p.returncode == 0 and "RESULT ok" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert "restores 2-2, warm (median)" in p.stdout, p.stdout
    # --store-reps 2: a second whole store under other keys, each rank's store stages printed
    assert any(line.startswith("  stores 2-2, warm (median)") and "  ok  " in line for line in p.stdout.splitlines())
    for r in range(4):
        assert any(line.startswith(f"  store 2 rank {r}: ") and " gather " in line for line in p.stdout.splitlines())
    # --settle waited for the write-behind; --timeline printed each rank's last retrieve from its
    # rankd's status: the request's stages and a batch's host stages and device scatter
    assert "L2 write-behind of every rank done" in p.stdout, p.stdout
    for r in range(4):
        assert f"timeline rank {r}, restore 2: " in p.stdout, p.stdout
    tl = [line for line in p.stdout.splitlines() if line.strip().startswith(("request:", "batch 0:"))]
    assert len(tl) == 8 and all("decode 0.00+" in line for line in tl[0::2]), tl
    assert all("lookup " in line and "scatter(dev) " in line for line in tl[1::2]), tl
    assert "TP4 (2 heads per rank)" in p.stdout and "16/16 chunk shards" in p.stdout, p.stdout
    # the store waits for the coordinator's resync of every rank (a restore while an inventory
    # streams in finds the rank hidden: a miss, this test's one failure, stop 39)
    assert "daemons ready: 4 ranks resynced by the coordinator" in p.stdout, p.stdout
    ranks = rank_rows(p.stdout)
    assert [(r[0], r[1], r[2], r[-1]) for r in ranks] == [(str(i), f"{2 * i},{2 * i + 1}", "262144", "ok")
                                                           for i in range(4)], p.stdout
    # the flip lands after the second restore: every repetition is checked, not only the first
    bad = roundtrip(binaries, tmp_path / "tamper", "--tamper", "3", "--restore-reps", "2")
    assert bad.returncode == 1 and "RESULT FAIL" in bad.stdout, bad.stdout[-3000:]
    assert [r[-1] for r in rank_rows(bad.stdout)] == ["ok", "ok", "ok", "FAIL"], bad.stdout
