package index

// SetFoldSortHook sets testHookFoldSort for the rest of the test binary's
// test (nil clears it).
func SetFoldSortHook(h func()) { testHookFoldSort = h }
