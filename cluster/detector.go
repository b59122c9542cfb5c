package cluster

import (
	"fmt"
	"math"
	"time"

	"github.com/hashicorp/memberlist"
)

// DetectorConfig holds the SWIM/Lifeguard failure-detector and gossip
// parameters handed to memberlist. DefaultDetector is tuned so that a dead
// member is declared dead at every survivor within 1.5 s of it ceasing to
// answer, on a LAN of GPU hosts, without false deaths in a healthy cluster.
//
// How memberlist (v0.7.0) turns a silent member D into a death, for a
// cluster of n members:
//
//  1. Wait until some survivor's round-robin probe reaches D. Each survivor
//     probes one member per ProbeInterval in its own shuffled order, so the
//     first probe of D comes after W, roughly exponential with mean about
//     ProbeInterval (p90 2.3, p99 4.6 ProbeIntervals for large n; bounded by
//     (n-1) intervals for small n).
//  2. The probe round: a UDP ping, after ProbeTimeout indirect pings through
//     IndirectChecks peers plus a TCP ping, all bounded by ProbeInterval.
//     The prober then suspects D and gossips it.
//  3. The suspicion timer at each survivor: min = SuspicionMult *
//     max(1, log10(n)) * ProbeInterval; it starts at max =
//     SuspicionMaxTimeoutMult * min and shrinks to min once k =
//     SuspicionMult-2 other members have independently confirmed the
//     suspicion (k = 0 when n-2 < k, then the timer is simply min). When it
//     fires the survivor declares D dead and gossips that.
//  4. The dead message spreads: GossipNodes peers every GossipInterval, and
//     piggybacked on probes.
//
// Death therefore takes about W + ProbeInterval + min + gossip, where the
// confirmations needed in step 3 come from other probers' failed rounds
// (each another W + ProbeInterval, which usually ends before min does).
//
// Chosen values and why (measured numbers: BENCHMARKS.md, "cluster: failure
// detection"):
//
//   - ProbeInterval 100 ms. It sets every term. n <= 10 gives W + 100 ms +
//     400 ms + ~50 ms of gossip: about 0.6 s typically, about 0.9 s at p99 of
//     W; n = 100 doubles min to 800 ms and still gives about 1.4 s at p99.
//     The cost is 10 pings and acks a second per member, nothing on a LAN.
//     125 ms tolerates slightly longer stalls but passes 1.5 s only up to
//     about 32 members; 200 ms only up to about 10.
//   - ProbeTimeout 40 ms. LAN round trips are well under 1 ms, so 40 ms
//     covers scheduling and GC stalls; a late direct ack still counts until
//     ProbeInterval ends. It must be below ProbeInterval/2: peers doing the
//     indirect ping answer "nack" after their own ProbeTimeout, and a nack
//     that arrives after the probe round counts against the prober's own
//     health (Lifeguard awareness), slowing its probing for no reason.
//     (memberlist's LAN default 500/1000 ms sits exactly on that edge.)
//   - SuspicionMult 4, so k = 2: two members besides the accuser must fail
//     their own probes before the 400 ms minimum applies. A lone accuser (a
//     prober starved of CPU, say a coordinator saturated by index ingest)
//     waits the maximum instead, and the accused refutes long before. With
//     SuspicionMult 3 (k = 1, min 300 ms) detection is 100 ms faster but a
//     cluster whose processes all stall for 250 ms at once produced false
//     deaths several times as often in the load test.
//   - SuspicionMaxTimeoutMult 5: a lone accusation lasts 2 s (n <= 10)
//     before it becomes a death, many refutation round trips; one
//     confirmation brings it to 1 s.
//   - IndirectChecks 3 (memberlist default): three other paths before
//     suspecting; their nacks feed the awareness score.
//   - AwarenessMaxMultiplier 8 (default): a member whose own probes keep
//     failing without nacks (it is the sick one) probes up to 8x slower, so
//     it accuses less. Healthy members are not slowed.
//   - GossipInterval 50 ms, GossipNodes 3: suspect, dead and refuting alive
//     messages reach 100 members in about 4 rounds, 200 ms. Rounds with
//     nothing queued send nothing.
//   - RetransmitMult 6: each node that learns a message forwards it
//     6*ceil(log10(n+1)) times. memberlist's 4 left one member of a freshly
//     started 9-member cluster unaware of another in a few percent of starts
//     (copies are also spent piggybacked on acks to members that already
//     know), until the next push/pull; 6 gave no miss in 100 starts.
//   - TCPTimeout 2 s: bounds join, push/pull and stream operations on a LAN
//     (memberlist's 10 s is for WANs); the TCP fallback ping uses the probe
//     deadline, not this.
//   - PushPullInterval 10 s: full-state anti-entropy with one random peer;
//     heals missed gossip and partitions. State is a few KB here.
//   - GossipToTheDeadTime 30 s (default): dead members keep getting gossip,
//     so a member wrongly declared dead learns it and refutes; after that
//     memberlist forgets them, and so does Members.
//
// What this does not survive: a process (or, in tests, a whole machine)
// that stalls for more than about ProbeInterval + min (0.5 s) is declared
// dead; that is the target working. When every member shares one starved
// runtime (the in-process load test) stalls from about 250 ms up can already
// produce a false death, because the confirmations then come from equally
// starved peers.
//
// Why the tuning stays this tight although inference hosts are often
// CPU-bound (issue 29.4): to kvtier a death here is only a suspicion. The
// coordinator acts on one only when the rank's own NATS channel confirms it
// (coordinator/deaths.go: the rank's connection gone, its leaving notice,
// or its heartbeats silent for a few of its 2 s intervals), so a false
// death of a starved process costs a refutation round and a counted
// notice, not a fence; and fast suspicion is what makes a real crash
// fenced within a second (its NATS connection is gone by then). Lifeguard's
// own defences (AwarenessMaxMultiplier, the confirmations SuspicionMult
// asks for) stay at the values above. Under 8 busy loops per core with the
// rankds at nice 10, memberlist declared 16 false deaths in 30 s, every one
// refuted by heartbeats at most 4 s apart (e2e
// TestSoakStarvedRanksNotFenced). Loosening the detector would trade
// detection speed for fewer of these notices, and a key holder could still
// forge them.
//
// Meta updates ride the same gossip: they are for data that changes every
// few seconds at most (addresses, tier usage snapshots), not for a stream.
//
// A restarted process does not reuse its memberlist node name: the name is
// NodeName@Incarnation (see Member.ID), so the new incarnation joins at once
// as a new node, even while the old one is still alive, suspect or dead at
// the survivors, and the old one is declared dead on its own. memberlist's
// DeadNodeReclaimTime (how long before a dead name may reappear at a new
// address) is therefore irrelevant and left at 0.
type DetectorConfig struct {
	// ProbeInterval is the time between two probes sent by one member; also
	// the deadline of one probe round. Default 100 ms. Lower detects faster
	// and sends more packets; it also shortens the window for a slow member
	// to answer a probe.
	ProbeInterval time.Duration
	// ProbeTimeout is how long a direct ping waits before indirect probes
	// start. Default 40 ms. Must be > 0 and 2*ProbeTimeout < ProbeInterval
	// (see the type comment). Higher means fewer indirect probes under load.
	ProbeTimeout time.Duration
	// SuspicionMult scales the suspicion timeout: min = SuspicionMult *
	// max(1, log10(n)) * ProbeInterval, and SuspicionMult-2 independent
	// confirmations are needed to reach min. Default 4 (2 confirmations).
	// Higher means fewer false deaths and slower detection.
	SuspicionMult int
	// SuspicionMaxTimeoutMult bounds the suspicion timeout without
	// confirmations at SuspicionMaxTimeoutMult * min. Default 5. Higher
	// protects more against a lone sick accuser, and slows detection by a
	// member that cannot reach the others.
	SuspicionMaxTimeoutMult int
	// IndirectChecks is the number of peers asked to ping a member that
	// missed a direct ping. Default 3. Higher means more paths, more packets.
	IndirectChecks int
	// AwarenessMaxMultiplier caps how much a member that sees itself
	// degraded (Lifeguard) stretches its probe interval. Default 8. 1
	// disables the back-off.
	AwarenessMaxMultiplier int
	// GossipInterval is the time between gossip rounds that flush queued
	// broadcasts (suspect, dead, alive/meta). Default 50 ms. Idle rounds send
	// nothing. Lower spreads news faster.
	GossipInterval time.Duration
	// GossipNodes is the number of random peers per gossip round. Default 3.
	GossipNodes int
	// RetransmitMult: each broadcast is sent RetransmitMult *
	// ceil(log10(n+1)) times by every member that learns it. Default 6.
	// Higher is more robust to loss and to copies wasted on members that
	// already know, at more packets per message.
	RetransmitMult int
	// TCPTimeout bounds a stream connection (join, push/pull, reliable
	// sends). Default 2 s. Too low fails joins and state syncs of busy
	// members; too high makes a join to a black-holed seed slow.
	TCPTimeout time.Duration
	// PushPullInterval is the time between full state syncs with a random
	// peer (scaled up by memberlist beyond 32 members). Default 10 s; 0
	// disables them, which is not advised.
	PushPullInterval time.Duration
	// GossipToTheDeadTime is how long dead members still receive gossip (so
	// they can refute a false death) and stay in Members. Default 30 s.
	GossipToTheDeadTime time.Duration
}

// DefaultDetector returns the failure-detector tuning described on
// DetectorConfig: a dead member is declared dead within 1.5 s on a LAN.
func DefaultDetector() DetectorConfig {
	return DetectorConfig{
		ProbeInterval:           100 * time.Millisecond,
		ProbeTimeout:            40 * time.Millisecond,
		SuspicionMult:           4,
		SuspicionMaxTimeoutMult: 5,
		IndirectChecks:          3,
		AwarenessMaxMultiplier:  8,
		GossipInterval:          50 * time.Millisecond,
		GossipNodes:             3,
		RetransmitMult:          6,
		TCPTimeout:              2 * time.Second,
		PushPullInterval:        10 * time.Second,
		GossipToTheDeadTime:     30 * time.Second,
	}
}

// Validate checks the detector rules; the error names the rule and numbers.
func (d *DetectorConfig) Validate() error {
	switch {
	case d.ProbeInterval <= 0:
		return fmt.Errorf("probe interval %v must be > 0: %w", d.ProbeInterval, ErrConfig)
	case d.ProbeTimeout <= 0:
		return fmt.Errorf("probe timeout %v must be > 0: %w", d.ProbeTimeout, ErrConfig)
	case 2*d.ProbeTimeout >= d.ProbeInterval:
		return fmt.Errorf("2 x probe timeout %v must be below probe interval %v so indirect nacks arrive within the probe round: %w",
			d.ProbeTimeout, d.ProbeInterval, ErrConfig)
	case d.SuspicionMult < 1:
		return fmt.Errorf("suspicion mult %d must be >= 1: %w", d.SuspicionMult, ErrConfig)
	case d.SuspicionMaxTimeoutMult < 1:
		return fmt.Errorf("suspicion max timeout mult %d must be >= 1: %w", d.SuspicionMaxTimeoutMult, ErrConfig)
	case d.IndirectChecks < 0:
		return fmt.Errorf("indirect checks %d must be >= 0: %w", d.IndirectChecks, ErrConfig)
	case d.AwarenessMaxMultiplier < 1:
		return fmt.Errorf("awareness max multiplier %d must be >= 1: %w", d.AwarenessMaxMultiplier, ErrConfig)
	case d.GossipInterval <= 0:
		return fmt.Errorf("gossip interval %v must be > 0: %w", d.GossipInterval, ErrConfig)
	case d.GossipNodes < 1:
		return fmt.Errorf("gossip nodes %d must be >= 1: %w", d.GossipNodes, ErrConfig)
	case d.RetransmitMult < 1:
		return fmt.Errorf("retransmit mult %d must be >= 1: %w", d.RetransmitMult, ErrConfig)
	case d.TCPTimeout <= 0:
		return fmt.Errorf("tcp timeout %v must be > 0: %w", d.TCPTimeout, ErrConfig)
	case d.PushPullInterval < 0:
		return fmt.Errorf("push/pull interval %v must be >= 0: %w", d.PushPullInterval, ErrConfig)
	case d.GossipToTheDeadTime <= 0:
		return fmt.Errorf("gossip-to-the-dead time %v must be > 0: %w", d.GossipToTheDeadTime, ErrConfig)
	}
	return nil
}

// Suspicion is memberlist's suspicion timer for one suspected member, as a
// pure function of the detector and the cluster size (memberlist v0.7.0
// suspectNode and suspicionTimeout).
type Suspicion struct {
	// Min is the timeout once Confirmations independent members agree.
	Min time.Duration
	// Max is the timeout with no confirmation (Min when Confirmations is 0).
	Max time.Duration
	// Confirmations is the number of independent confirmations (k) that
	// drive the timer from Max down to Min.
	Confirmations int
}

// SuspicionFor returns the suspicion timer memberlist uses in a cluster of n
// members (n counts every member memberlist knows, dead ones included until
// they are forgotten).
func (d *DetectorConfig) SuspicionFor(n int) Suspicion {
	scale := math.Max(1, math.Log10(math.Max(1, float64(n))))
	minT := time.Duration(d.SuspicionMult) * time.Duration(scale*1000) * d.ProbeInterval / 1000
	k := d.SuspicionMult - 2
	if n-2 < k || k < 0 {
		k = 0
	}
	maxT := time.Duration(d.SuspicionMaxTimeoutMult) * minT
	if k == 0 {
		maxT = minT
	}
	return Suspicion{Min: minT, Max: maxT, Confirmations: k}
}

// TypicalDetection estimates how long a cluster of n members takes to
// declare a silent member dead when it is probed at once and confirmed in
// time: one probe round plus the minimum suspicion timeout. Real detections
// add the wait for the first probe (about one ProbeInterval on average) and
// the gossip of the verdict.
func (d *DetectorConfig) TypicalDetection(n int) time.Duration {
	return d.ProbeInterval + d.SuspicionFor(n).Min
}

// apply copies the detector into a memberlist config.
func (d *DetectorConfig) apply(mc *memberlist.Config) {
	mc.ProbeInterval = d.ProbeInterval
	mc.ProbeTimeout = d.ProbeTimeout
	mc.SuspicionMult = d.SuspicionMult
	mc.SuspicionMaxTimeoutMult = d.SuspicionMaxTimeoutMult
	mc.IndirectChecks = d.IndirectChecks
	mc.AwarenessMaxMultiplier = d.AwarenessMaxMultiplier
	mc.GossipInterval = d.GossipInterval
	mc.GossipNodes = d.GossipNodes
	mc.RetransmitMult = d.RetransmitMult
	mc.TCPTimeout = d.TCPTimeout
	mc.PushPullInterval = d.PushPullInterval
	mc.GossipToTheDeadTime = d.GossipToTheDeadTime
	mc.DeadNodeReclaimTime = 0 // names carry the incarnation; see DetectorConfig
}
