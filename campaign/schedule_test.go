package campaign

import (
	"reflect"
	"testing"
)

// TestScheduleIsAFunctionOfTheSeed: the same seed replays the same
// schedule; another seed gives another; every kind appears in a long
// schedule; coordinator faults target -1 and durations are set where the
// kind has one.
func TestScheduleIsAFunctionOfTheSeed(t *testing.T) {
	a, b := Schedule(42, 5000, 10, 4), Schedule(42, 5000, 10, 4)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("seed 42 gave two different schedules")
	}
	c := Schedule(43, 5000, 10, 4)
	same := 0
	for i := range a {
		if a[i].Kind == c[i].Kind && a[i].Target == c[i].Target && a[i].Pick == c[i].Pick {
			same++
		}
	}
	if same > 50 {
		t.Fatalf("seeds 42 and 43 agree on %d of 5000 faults", same)
	}
	seen := map[Kind]int{}
	for i, f := range a {
		seen[f.Kind]++
		if f.Seq != i+1 {
			t.Fatalf("fault %d has seq %d", i, f.Seq)
		}
		coord := f.Kind == KillCoordinator || f.Kind == StopCoordinator
		if coord != (f.Target == -1) || f.Target < -1 || f.Target > 3 {
			t.Fatalf("%v: target %d", f, f.Target)
		}
		needFor := map[Kind]bool{NATSDelay: true, KillRankd: true, KillCoordinator: true, StopRankd: true,
			StopCoordinator: true, Partition: true, LossyLink: true, L2NoSpace: true}[f.Kind]
		if needFor != (f.For > 0) {
			t.Fatalf("%v: duration %v", f, f.For)
		}
	}
	for _, k := range Kinds() {
		if seen[k] == 0 {
			t.Errorf("kind %s never drawn in 5000 faults", k)
		}
	}
}
