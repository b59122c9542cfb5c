package wire

import (
	"reflect"
	"testing"
)

// TestFailedReasonsNamesEveryGroup: the line per failed chunk names every
// failed group (GroupReasons), falls back to the first group's reason of an
// older coordinator's verdict, and keeps a refused verdict's reason.
func TestFailedReasonsNamesEveryGroup(t *testing.T) {
	v := RestoreVerdict{State: VerdictFailed, Failed: []int{1, 3},
		Reasons:      []string{"chunk 1: rank 0 group 0 shard 0: missing", "chunk 3: rank 1 group 1 shard 0: corrupt"},
		GroupReasons: [][]string{{"rank 0 group 0 shard 0: missing", "rank 0 group 1 shard 0: corrupt"}, {"rank 1 group 1 shard 0: corrupt"}}}
	want := []string{"chunk 1: rank 0 group 0 shard 0: missing; rank 0 group 1 shard 0: corrupt", "chunk 3: rank 1 group 1 shard 0: corrupt"}
	if got := v.FailedReasons(); !reflect.DeepEqual(got, want) {
		t.Fatalf("FailedReasons = %q, want %q", got, want)
	}
	old := v
	old.GroupReasons = nil
	want = []string{"chunk 1: rank 0 group 0 shard 0: missing", "chunk 3: rank 1 group 1 shard 0: corrupt"}
	if got := old.FailedReasons(); !reflect.DeepEqual(got, want) {
		t.Fatalf("without GroupReasons: %q, want %q", got, want)
	}
	refused := RestoreVerdict{State: VerdictRefused, Reasons: []string{"unknown restore"}}
	if got := refused.FailedReasons(); !reflect.DeepEqual(got, refused.Reasons) {
		t.Fatalf("refused: %q, want %q", got, refused.Reasons)
	}
}
