package rankd

import (
	"path/filepath"
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

// l2FreeFloor is the L2 free-space floor in bytes (transfer.Config.
// L2FreeFloorBytes): the larger of cfg.L2FreeFloorBytes and
// cfg.L2FreeFloorPercent % of the size of the file system under L2Dir, or
// of its nearest existing parent (the engine creates the directory); the
// bytes alone when no size can be read. 0 without L2.
func l2FreeFloor(cfg *Config) uint64 {
	if cfg.L2Dir == "" {
		return 0
	}
	floor := cfg.L2FreeFloorBytes
	if cfg.L2FreeFloorPercent <= 0 {
		return floor
	}
	size := uint64(wire.CapacityUnbounded)
	for dir := filepath.Clean(cfg.L2Dir); size == wire.CapacityUnbounded; dir = filepath.Dir(dir) {
		size = fileSystemBytes(dir)
		if dir == filepath.Dir(dir) {
			break
		}
	}
	if size == wire.CapacityUnbounded {
		return floor
	}
	return max(floor, uint64(float64(size)*cfg.L2FreeFloorPercent/100))
}
