package index

import "github.com/kvtier/kvtier/wire"

// SetFoldSortHook sets testHookFoldSort for the rest of the test binary's
// test (nil clears it).
func SetFoldSortHook(h func()) { testHookFoldSort = h }

// SetCompactHook sets testHookCompact (nil clears it).
func SetCompactHook(h func(wire.Rank)) { testHookCompact = h }

// SetCompactSlack sets compactSlack and returns its previous value.
func SetCompactSlack(n int) int {
	old := compactSlack
	compactSlack = n
	return old
}

// SetSlabCompactMin sets slabCompactMin and returns its previous value.
func SetSlabCompactMin(n uint32) uint32 {
	old := slabCompactMin
	slabCompactMin = n
	return old
}

// RankChunkProblems checks every rank's chunk list against the chunks of
// the live state (checkRankChunks), under Index.mu.
func RankChunkProblems(ix *Index) []string {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var pr problems
	checkRankChunks(&pr, ix.st)
	return pr.list
}

// Compacting reports how many chunk-list compactions are in flight or
// waiting to be installed.
func Compacting(ix *Index) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.st.compacting)
}

// CloseGoroutines closes ix's goroutine group as Close does first, without
// stopping the committer: every later hand-off is refused and runs on the
// committer (Close then waits as usual).
func CloseGoroutines(ix *Index) { ix.goroutines.Close() }

// Goroutines is how many goroutines ix's group is running.
func Goroutines(ix *Index) int { return ix.goroutines.Running() }
