package campaign

import (
	"slices"
	"testing"
)

// TestPromptTokensSharePrefixes: requests sharing hash ids on a prefix
// share those tokens exactly and differ after; short requests give nil;
// the chunk cap and the tail cap hold.
func TestPromptTokensSharePrefixes(t *testing.T) {
	a := PromptTokens(6758, []uint64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 4)
	b := PromptTokens(7322, []uint64{0, 1, 2, 3, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24}, 4)
	if len(a) != 3*2048+511 || len(b) != 3*2048+511 {
		t.Fatalf("lengths %d %d, want %d", len(a), len(b), 3*2048+511)
	}
	if !slices.Equal(a[:2048], b[:2048]) {
		t.Fatal("the shared first chunk differs")
	}
	if slices.Equal(a[2048:4096], b[2048:4096]) {
		t.Fatal("different second chunks agree")
	}
	if p := PromptTokens(2000, []uint64{0, 1, 2, 3}, 4); p != nil {
		t.Fatalf("a 2000-token request gave %d tokens", len(p))
	}
	if p := PromptTokens(20000, make([]uint64, 40), 2); len(p) != 2*2048+511 {
		t.Fatalf("cap of 2 chunks: %d tokens", len(p))
	}
}
