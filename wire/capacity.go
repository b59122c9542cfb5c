package wire

import "math"

// Capacity is what a rank declares it can hold, in bytes per tier (issue
// 28.3): its L1 pool, the bound of its L2 files (or, unbounded, the size
// of the file system they live on) and the bound of its L3 objects. The
// coordinator bounds the rank's placements by Total over the smallest
// object size of any registered namespace, and by its own per-rank cap,
// so a rank that declares more than it holds gains nothing beyond that
// cap. It travels in the rank's heartbeats (Heartbeat.Capacity), on the
// rank's own authenticated subject, never in gossip.
type Capacity struct {
	L1Bytes uint64 `json:"l1_bytes"`
	L2Bytes uint64 `json:"l2_bytes,omitempty"`
	L3Bytes uint64 `json:"l3_bytes,omitempty"`
}

// CapacityUnbounded is the bytes a tier without a bound declares.
const CapacityUnbounded = math.MaxUint64

// Total is L1Bytes + L2Bytes + L3Bytes, saturating at CapacityUnbounded.
func (c Capacity) Total() uint64 {
	t := c.L1Bytes
	for _, v := range []uint64{c.L2Bytes, c.L3Bytes} {
		if t > CapacityUnbounded-v {
			return CapacityUnbounded
		}
		t += v
	}
	return t
}
