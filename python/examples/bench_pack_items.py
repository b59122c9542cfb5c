"""What handing a load's items from the vLLM connector's scheduler to its
workers costs per item: the generic codec's JSON (what the connector sent
before) against kvtier.client_plan.pack_items / unpack_items (what it
sends now). In process, CPU only:

    python examples/bench_pack_items.py [ITEMS] [REPS]
"""

from __future__ import annotations

import sys
import time

from kvtier import _codec, client_plan, dcp, wire


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    ns = dcp.Namespace(bytes([1]) * 16)
    items = [wire.RetrieveItem(i // 2, i % 2, dcp.Key(ns, dcp.ChunkHash(bytes([i // 2 % 256]) * 16), 0, i % 2),
                               0x0123456789ABCDEF + i, wire.Source(wire.Rank("engine0", 0), wire.Tier.L1))
             for i in range(n)]

    def per_item(f) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best / n * 1e6

    raw = _codec.dumps([_codec.to_obj(it) for it in items])
    packed = client_plan.pack_items(items)
    assert [_codec.from_obj(wire.RetrieveItem, x, "item") for x in _codec.loads(raw)] == items
    assert client_plan.unpack_items(packed) == items
    rows = [
        ("JSON (generic codec)", len(raw),
         per_item(lambda: _codec.dumps([_codec.to_obj(it) for it in items])),
         per_item(lambda: [_codec.from_obj(wire.RetrieveItem, x, "item") for x in _codec.loads(raw)])),
        ("packed (KVI1)", len(packed), per_item(lambda: client_plan.pack_items(items)),
         per_item(lambda: client_plan.unpack_items(packed))),
    ]
    print(f"{n} items, best of {reps}")
    print("| form | bytes | encode us/item | decode us/item | total us/item |")
    print("|---|---|---|---|---|")
    for name, size, enc, dec in rows:
        print(f"| {name} | {size} | {enc:.2f} | {dec:.2f} | {enc + dec:.2f} |")


if __name__ == "__main__":
    main()
