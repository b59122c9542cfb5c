package campaign

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Kind is a kind of injected fault.
type Kind string

// The fault kinds. Target is a TP rank (0..Ranks-1) unless the kind names
// the coordinator.
const (
	KillRankd       Kind = "kill_rankd"       // SIGKILL, restarted after For
	StopRankd       Kind = "stop_rankd"       // SIGSTOP, SIGCONT after For
	KillCoordinator Kind = "kill_coordinator" // SIGKILL, restarted after For
	StopCoordinator Kind = "stop_coordinator" // SIGSTOP, SIGCONT after For
	L2BitFlip       Kind = "l2_bitflip"       // one bit of one L2 object file
	L2Truncate      Kind = "l2_truncate"      // an L2 object file cut short
	L2Delete        Kind = "l2_delete"        // an L2 object file removed
	L2Swap          Kind = "l2_swap"          // two L2 object files exchange contents
	L2NoSpace       Kind = "l2_enospc"        // the L2 file system full for For
	NATSDrop        Kind = "nats_drop"        // the next Count message frames vanish
	NATSDup         Kind = "nats_dup"         // the next Count message frames arrive twice
	NATSReorder     Kind = "nats_reorder"     // the next message frame is overtaken by the one after it
	NATSDelay       Kind = "nats_delay"       // the stream stalls for For
	NATSCut         Kind = "nats_cut"         // the rank's NATS connections are closed
	Partition       Kind = "partition"        // the rank's link is down for For
	LossyLink       Kind = "lossy_link"       // the rank's link flaps (packets lost) for For
	L3BitFlip       Kind = "l3_bitflip"       // one bit of one L3 object
	L3Truncate      Kind = "l3_truncate"      // an L3 object cut short
	L3Delete        Kind = "l3_delete"        // an L3 object removed
)

// weights say how often each kind is drawn (relative weights, 1,050 in
// all; the L3 kinds came last, with 50). At 11 faults/s
// (10,000 in about 15 minutes) a rankd is killed about every 11 s, the
// coordinator every 30 s, a rank partitioned or its link made lossy every
// 6 s; an L2 file is damaged 5 times a second. The daemons' NATS traffic
// is only a few message frames a second per direction, so frame faults
// stay under half of the schedule and drops (each costs its sender a
// timeout) near 0.4/s: more would fault nearly every frame and the engine
// would reach no verdict to check.
var weights = []struct {
	kind Kind
	w    int
}{
	{NATSDrop, 40}, {NATSDup, 210}, {NATSReorder, 200}, {NATSDelay, 20}, {NATSCut, 6},
	{L2BitFlip, 150}, {L2Truncate, 110}, {L2Delete, 110}, {L2Swap, 110}, {L2NoSpace, 5},
	{KillRankd, 8}, {StopRankd, 10}, {KillCoordinator, 3}, {StopCoordinator, 3},
	{Partition, 8}, {LossyLink, 7},
	{L3BitFlip, 20}, {L3Truncate, 15}, {L3Delete, 15},
}

// Kinds lists every fault kind in schedule order.
func Kinds() []Kind {
	out := make([]Kind, len(weights))
	for i, w := range weights {
		out[i] = w.kind
	}
	return out
}

// Fault is one scheduled fault.
type Fault struct {
	// Seq numbers the faults from 1 in schedule order.
	Seq int `json:"seq"`
	// At is the offset from the campaign's start at which it is injected.
	At time.Duration `json:"at_ns"`
	// Kind is what is done.
	Kind Kind `json:"kind"`
	// Target is the TP rank it hits (-1: the coordinator).
	Target int `json:"target"`
	// Dir is the NATS direction of a frame fault: 0 rankd to NATS, 1 NATS
	// to rankd.
	Dir int `json:"dir"`
	// Count is the number of frames of a drop or duplication.
	Count int `json:"count,omitempty"`
	// For is how long a fault with a duration lasts (down time after a
	// kill, stop, stall, partition, full file system).
	For time.Duration `json:"for_ns,omitempty"`
	// Pick chooses among runtime objects (L2 files, bit offsets); the same
	// pick against the same files chooses the same ones.
	Pick uint64 `json:"pick"`
}

func (f Fault) String() string {
	t := fmt.Sprintf("rank %d", f.Target)
	if f.Target < 0 {
		t = "coordinator"
	}
	return fmt.Sprintf("#%d %s %s dir=%d count=%d for=%v pick=%#x", f.Seq, f.Kind, t, f.Dir, f.Count, f.For, f.Pick)
}

// Schedule returns n faults for seed, rate faults per second over ranks
// TP ranks. It is a pure function of its arguments: the same seed gives
// the same schedule.
func Schedule(seed uint64, n int, rate float64, ranks int) []Fault {
	rng := rand.New(rand.NewPCG(seed, 0x6b76746965722d63)) // "kvtier-c"
	total := 0
	for _, w := range weights {
		total += w.w
	}
	gap := time.Duration(float64(time.Second) / rate)
	out := make([]Fault, n)
	for i := range out {
		x := rng.IntN(total)
		var k Kind
		for _, w := range weights {
			if x < w.w {
				k = w.kind
				break
			}
			x -= w.w
		}
		f := Fault{Seq: i + 1, At: time.Duration(i+1) * gap, Kind: k, Target: rng.IntN(ranks),
			Dir: rng.IntN(2), Pick: rng.Uint64()}
		switch k {
		case KillCoordinator, StopCoordinator:
			f.Target = -1
		}
		switch k {
		case NATSDrop, NATSDup:
			f.Count = 1 + rng.IntN(3)
		case NATSDelay:
			f.For = time.Duration(50+rng.IntN(450)) * time.Millisecond
		case KillRankd, KillCoordinator:
			f.For = time.Duration(200+rng.IntN(1800)) * time.Millisecond
		case StopRankd, StopCoordinator:
			// Some stops outlast memberlist's suspicion (the rank is
			// declared dead and fenced), most do not.
			f.For = time.Duration(100+rng.IntN(2900)) * time.Millisecond
		case Partition, LossyLink:
			f.For = time.Duration(300+rng.IntN(2700)) * time.Millisecond
		case L2NoSpace:
			f.For = time.Duration(500+rng.IntN(3500)) * time.Millisecond
		}
		out[i] = f
	}
	return out
}
