"""What the Python side of one rank's restore costs per item, in process,
CPU only: from the coordinator's binary plan to the retrieve request the
rank's rankd gets, and the rankd's reply, two ways:

- objects: decode_plan_binary (a RetrieveItem per item), blocks set on
  each, RetrieveRequest.to_binary, decode_retrieve_reply (what the vLLM
  connector did until the packed path);
- packed: decode_plan_packed, PlanItems.to_bytes / from_bytes (the
  scheduler hands the items to its workers), PlanItems.retrieve_request,
  and only the reply's envelope checked (what it does now).

    python examples/bench_load_items.py [CHUNKS] [REPS]

One attention group, one rank (TP 1): an item per chunk.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Callable

from kvtier import client, client_plan, dcp, wire


def plan_bytes(ns: dcp.Namespace, n: int) -> bytes:
    """A KVP1 plan of n chunks for reader engine0/0 (Go wire/plan.go)."""
    rid = b"r-00000001"
    out = bytearray(b"KVP1") + bytes([len(rid)]) + rid + n.to_bytes(4, "big") + (0).to_bytes(2, "big") + bytes(ns)
    out += (1).to_bytes(2, "big") + bytes([7]) + b"engine0" + (0).to_bytes(2, "big")  # holders
    out += (1).to_bytes(2, "big") + bytes([7]) + b"engine0" + (0).to_bytes(2, "big")  # readers
    out += (1).to_bytes(2, "big") + struct.pack(">HH", 0, 0)  # one expectation: group 0, shard 0
    for i in range(n):
        out += struct.pack(">QHB", 0x0123456789ABCDEF + i, 0, 1)
    return bytes(out)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    ns = dcp.Namespace(bytes([1]) * 16)
    chunks = [dcp.ChunkHash(i.to_bytes(16, "big")) for i in range(n)]
    data = plan_bytes(ns, n)
    ids = [list(range(100, 100 + n))]
    reply = json.dumps({"ok": {"results": [{"chunk": i, "group": 0, "ok": True, "sum": 0x0123456789ABCDEF + i}
                                           for i in range(n)]}}, separators=(",", ":")).encode()

    def per_item(f: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best / n * 1e6

    def objects() -> bytes:
        items = client_plan.decode_plan_binary(data, chunks).ranks["engine0/0"]
        for it in items:
            it.blocks = ids[0][it.chunk:it.chunk + 1]
        return wire.RetrieveRequest("r-00000001", ns, "sess", items).to_binary()

    def packed() -> bytes:
        raw = client_plan.decode_plan_packed(data, chunks).ranks["engine0/0"].to_bytes()
        return client_plan.PlanItems.from_bytes(raw).retrieve_request("r-00000001", "sess", ids, [1])

    assert objects() == packed()
    rows = [("objects", per_item(lambda: client_plan.decode_plan_binary(data, chunks)), per_item(objects),
             per_item(lambda: client.decode_retrieve_reply(reply))),
            ("packed", per_item(lambda: client_plan.decode_plan_packed(data, chunks)), per_item(packed),
             per_item(lambda: client._check_retrieve_reply(reply)))]
    print(f"{n} chunks, one rank, best of {reps} (us per item)")
    print("| path | plan decode | plan to retrieve request (incl. decode) | reply | total |")
    print("|---|---|---|---|---|")
    for name, dec, req, rep in rows:
        print(f"| {name} | {dec:.2f} | {req:.2f} | {rep:.2f} | {req + rep:.2f} |")


if __name__ == "__main__":
    main()
