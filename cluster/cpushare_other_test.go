//go:build !unix

package cluster

import "time"

// processCPU is not available here; the load test then trusts the machine.
func processCPU() (time.Duration, bool) { return 0, false }
