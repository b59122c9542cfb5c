package rankd

import (
	"syscall"

	"github.com/kvtier/kvtier/wire"
)

// declaredCapacity is what this rank declares it can hold (issue 28.3),
// sent in every heartbeat on its own subject: its L1 pool; its L2 bound,
// or, with L2 unbounded, the size of the file system under L2Dir (what it
// could hold at most; unbounded when that cannot be read); its L3 bound,
// or unbounded with an unbounded L3. The coordinator holds the rank's
// placements to that over the smallest object of a registered namespace,
// and to its own per-rank cap whatever is declared.
func declaredCapacity(cfg *Config) wire.Capacity {
	c := wire.Capacity{L1Bytes: cfg.L1Bytes}
	switch {
	case cfg.L2Dir == "":
	case cfg.L2Bytes > 0:
		c.L2Bytes = cfg.L2Bytes
	default:
		c.L2Bytes = fileSystemBytes(cfg.L2Dir)
	}
	switch {
	case cfg.L3.Endpoint == "":
	case cfg.L3Bytes > 0:
		c.L3Bytes = cfg.L3Bytes
	default:
		c.L3Bytes = wire.CapacityUnbounded
	}
	return c
}

// fileSystemBytes is the size of the file system holding dir, or
// wire.CapacityUnbounded when it cannot be read.
func fileSystemBytes(dir string) uint64 {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil || st.Bsize <= 0 {
		return wire.CapacityUnbounded
	}
	return st.Blocks * uint64(st.Bsize)
}
