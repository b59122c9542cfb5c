package coordinator

import (
	"math"
	"math/bits"
	"sync"
	"time"
)

// The load term of admin.route's ranking (route.go, docs/sharing.md). In
// a share group every member's prefix is the same (they all read the
// group's L2), so without it the ranking fell to own_prefix, and the
// member that first stored a block every prompt starts with ranked first
// for every prompt: in the share-group replay of the Mooncake trace
// 12,028 of 12,031 requests went to one instance (BENCHMARKS.md, issue
// 26). A member's load is the rate of its engines' lookups, which the
// coordinator answers anyway: each request an engine serves starts with
// one. Ranked by it below prefix and l1_prefix (a shared L2 copy restores
// as fast as an own one; DRAM does not) and above own_prefix, coarsely
// (loadLevel), so that members within a factor of two of each other's load
// still go by own_prefix: the member that holds a conversation's earlier
// turns keeps them recent in its own L2, which another member's reads do
// not.

// loadTau is the time constant of a member's decayed lookup count: at a
// steady rate of r lookups/s the count reads r.
const loadTau = time.Second

// memberLoad is one share-group member's decayed count of engine lookups.
type memberLoad struct {
	mu    sync.Mutex
	value float64   // as of at
	at    time.Time // zero: never looked up
}

// decayed is the count at now; l.mu held.
func (l *memberLoad) decayed(now time.Time) float64 {
	if l.at.IsZero() {
		return 0
	}
	return l.value * math.Exp(-float64(now.Sub(l.at))/float64(loadTau))
}

// add counts one lookup at now.
func (l *memberLoad) add(now time.Time) {
	l.mu.Lock()
	l.value, l.at = l.decayed(now)+1, now
	l.mu.Unlock()
}

// read returns the rate of lookups at now (per second).
func (l *memberLoad) read(now time.Time) float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.decayed(now) * float64(time.Second) / float64(loadTau)
}

// loadLevel is load's power of two (0 below 1 lookup/s, 1 below 2, 2 below
// 4, ...): loads in one level tie, so a member is passed over for its load
// only when it carries about twice another's.
func loadLevel(load float64) int { return bits.Len(uint(load)) }

// noteLookup counts an engine lookup of instance, if it is in a share
// group (only members are ranked, and the set stays bounded by the
// configuration whatever instances an insecure bus names).
func (s *shareState) noteLookup(instance string, now time.Time) {
	if l := s.load[instance]; l != nil {
		l.add(now)
	}
}

// loadOf returns instance's lookups per second (0 outside a group).
func (s *shareState) loadOf(instance string, now time.Time) float64 {
	if l := s.load[instance]; l != nil {
		return l.read(now)
	}
	return 0
}
