package cuda

// SetCopyPath forces the copy path of a device's Gather and Scatter:
// "auto", "sm" or "dma" (ForceCopyPath); a bad path is the test's bug.
func SetCopyPath(dev Device, path string) {
	if err := ForceCopyPath(dev, path); err != nil {
		panic(err)
	}
}
