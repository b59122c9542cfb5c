"""kvtier's DCP token mapping against vLLM's own code.

vLLM computes where each token's KV goes under decode context parallel in a
Triton kernel (vllm/v1/worker/block_table.py, ComputeSlotMappingKernel): a
rank writes a position to block_table[pos // (block_size*W)]*block_size +
local offset when (offset // interleave) % W is its DCP rank, else pads.
This test runs that very kernel source, from the installed vLLM, in
Triton's CPU interpreter (TRITON_INTERPRET=1; vLLM itself disables Triton on
a machine without a GPU driver, so the kernel is re-jitted with the real
triton module), for every DCP rank of many layouts, and requires
kvtier.dcp.Layout.local_slot to give the owner exactly vLLM's slot and every
other rank vLLM's pad. It also runs the kernel on the cases of
dcp/testdata/vllm_dcp_slots.json (which the Go dcp tests hold LocalSlot
to), so the Go restatement of vLLM's formula is checked against vLLM too.

Run by `make test-vllm` (python/.venv-vllm)."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import pytest

from kvtier import dcp

pytestmark = pytest.mark.vllm

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "dcp" / "testdata" / "vllm_dcp_slots.json"

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before triton is
# imported. Reads cases from stdin, writes [rank][position] slots per case.
KERNEL_RUNNER = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
import vllm.v1.worker.block_table as bt
from vllm.v1.attention.backends.utils import PAD_SLOT_ID
bt.tl = tl  # the module's own tl is vLLM's placeholder without a GPU driver
raw = bt.ComputeSlotMappingKernel.__dict__["kernel"]
kernel = triton.jit(getattr(raw, "__func__", raw))
out = []
for c in json.load(sys.stdin):
    # one request per case, its positions starting at c["start"] (a prefill
    # after a prefix); the block table row padded like vLLM's
    table = torch.zeros((2, len(c["table"]) + 3), dtype=torch.int32)
    table[1, :len(c["table"])] = torch.tensor(c["table"], dtype=torch.int32)
    n = c["n"]
    pos = torch.arange(c["start"], c["start"] + n, dtype=torch.int64)
    # request 0 is empty, request 1 is the case (row_offset != 0 is exercised)
    qsl = torch.tensor([0, 0, n], dtype=torch.int32)
    ranks = []
    for r in range(c["dcp"]):
        slots = torch.full((n + 5,), -7, dtype=torch.int64)
        kernel[(3,)](n, n + 5, qsl, pos, table, table.stride(0), slots, KV_CACHE_BLOCK_SIZE=c["block_size"],
                     TOTAL_CP_WORLD_SIZE=c["dcp"], TOTAL_CP_RANK=r, CP_KV_CACHE_INTERLEAVE_SIZE=c["interleave"],
                     PAD_ID=PAD_SLOT_ID, BLOCK_SIZE=64)
        ranks.append(slots[:n].tolist())
        assert slots[n:].tolist() == [PAD_SLOT_ID] * 5
    out.append(ranks)
print(json.dumps({"pad": PAD_SLOT_ID, "slots": out}))
'''


def run_vllm_kernel(cases: list[dict]) -> tuple[int, list[list[list[int]]]]:
    p = subprocess.run([sys.executable, "-c", KERNEL_RUNNER], input=json.dumps(cases), capture_output=True,
                       text=True, timeout=900)
    if p.returncode != 0:
        pytest.fail(f"vLLM's slot mapping kernel did not run (rc {p.returncode}):\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return res["pad"], res["slots"]


def cases() -> list[dict]:
    rng = random.Random(17)
    out = []
    for w in (1, 2, 3, 4, 8):
        for i in (1, 2, 4, 16):
            for bs in (16, 32):
                if bs % i:
                    continue
                vblocks = 1 + rng.randrange(3)
                table = rng.sample(range(40), vblocks)
                start = rng.randrange(bs * w) if rng.random() < 0.5 else 0
                n = bs * w * vblocks - start
                out.append(dict(dcp=w, interleave=i, block_size=bs, table=table, start=start, n=n))
    return out


def test_local_slot_equals_vllms_slot_mapping_kernel() -> None:
    cs = cases()
    golden = json.loads(GOLDEN.read_text())
    gcs = [dict(dcp=g["dcp"], interleave=g["interleave"], block_size=g["block_size"], table=g["table"], start=0,
                n=len(g["slots"][0])) for g in golden]
    pad, slots = run_vllm_kernel(cs + gcs)
    assert pad == -1 and len(slots) == len(cs) + len(gcs)
    compared = 0
    for c, per_rank in zip(cs + gcs, slots, strict=True):
        lay = dcp.Layout(tp=2 * c["dcp"], dcp=c["dcp"], interleave=c["interleave"])
        for k in range(c["n"]):
            pos = c["start"] + k
            r, slot = lay.local_slot(pos, c["block_size"], c["table"])
            got = [per_rank[q][k] for q in range(c["dcp"])]
            want = [slot if q == r else pad for q in range(c["dcp"])]
            assert got == want, f"{c} position {pos}: vLLM's kernel gives {got}, kvtier {want}"
            compared += 1
    for g, per_rank in zip(golden, slots[len(cs):], strict=True):
        assert per_rank == g["slots"], f"golden case {g['dcp']}/{g['interleave']}/{g['block_size']} is not vLLM's"
    assert compared > 5000
