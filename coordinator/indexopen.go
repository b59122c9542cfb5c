package coordinator

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/index"
	bolterr "go.etcd.io/bbolt/errors"
	"go.uber.org/zap"
)

// openIndex opens the index in DataDir and verifies it: a coordinator
// restarted after a crash must not serve from a damaged index. What that
// checks (index/doc.go): Open decodes every record and checks the CRC-32C
// of every sealed one, so a record damaged on disk refuses the start
// (ErrCorruptIndex); Verify then checks the invariants (counters against a
// recount of the chunks, incarnations and sequences of every placement
// against its rank, no fenced L1 copy). Its comparison of the live state
// with a second load of the same bytes cannot fail at startup; it is there
// for admin verify on a running index.
func (c *Coordinator) openIndex() error {
	icfg := index.DefaultConfig()
	icfg.Path = filepath.Join(c.cfg.DataDir, IndexFile)
	icfg.Logger = c.cfg.Logger
	icfg.Registerer = c.reg
	icfg.MaxFileBytes = c.cfg.IndexMaxFileBytes
	icfg.HostSharedL1 = c.cfg.HostSharedL1
	icfg.SharedL3 = c.cfg.ShareL3
	icfg.SharedL1 = c.cfg.ShareHostL1
	icfg.AfterCommit = c.cfg.indexAfterCommit
	if c.cfg.indexOpenHook != nil {
		c.cfg.indexOpenHook()
	}
	t0 := time.Now()
	idx, err := index.Open(icfg)
	if err != nil {
		if errors.Is(err, index.ErrCorrupt) || errors.Is(err, bolterr.ErrInvalid) ||
			errors.Is(err, bolterr.ErrChecksum) || errors.Is(err, bolterr.ErrVersionMismatch) {
			return fmt.Errorf("index %s does not decode; refusing to start (move it aside to start empty, the ranks resync): %w: %w",
				icfg.Path, ErrCorruptIndex, err)
		}
		return fmt.Errorf("open index: %w", err)
	}
	c.idx = idx
	rep, err := idx.Verify(c.ctx)
	if err != nil {
		c.log.Error("index verification failed at start; refusing to start", zap.String("path", icfg.Path),
			zap.Error(err))
		if errors.Is(err, index.ErrInconsistent) {
			return fmt.Errorf("index %s failed verification; refusing to start (move it aside to start empty, the ranks resync): %w: %w",
				icfg.Path, ErrCorruptIndex, err)
		}
		return fmt.Errorf("verify index %s: %w", icfg.Path, err)
	}
	c.log.Info("index opened and verified", zap.String("path", icfg.Path), zap.Int("namespaces", rep.Namespaces),
		zap.Int("ranks", rep.Ranks), zap.Int64("chunks", rep.Chunks), zap.Int64("placements", rep.Placements),
		zap.Int("log_records_replayed", rep.LogRecords), zap.Duration("took", time.Since(t0)))
	return nil
}

// setIndexAside renames the damaged index file (why says what failed)
// to IndexFile.damaged-<UTC time> in DataDir, durably, so the next open
// starts empty. The file is never deleted: an operator may inspect it.
func (c *Coordinator) setIndexAside(why error) error {
	if c.idx != nil { // opened, then failed verification
		_ = c.idx.Close()
		c.idx = nil
	}
	path := filepath.Join(c.cfg.DataDir, IndexFile)
	aside := path + ".damaged-" + time.Now().UTC().Format("20060102T150405.000000000Z")
	if err := os.Rename(path, aside); err != nil {
		return fmt.Errorf("--rebuild-index: set the damaged index %s aside: %w", path, err)
	}
	if d, err := os.Open(c.cfg.DataDir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	c.met.indexRebuilds.Inc()
	c.log.Warn("--rebuild-index: the damaged index was set aside; starting empty, every rank resyncs its inventory",
		zap.String("damaged", aside), zap.Error(why))
	return nil
}

// resyncAllRanks starts a resync of every live rankd member (after a
// rebuild of the index: the ranks' inventories refill it).
func (c *Coordinator) resyncAllRanks() {
	n := 0
	for _, m := range c.member.Members() {
		if m.Meta.Role != cluster.RoleRankd || m.State != cluster.StateAlive {
			continue
		}
		c.startResync(memberRank(m))
		n++
	}
	c.log.Info("index rebuild: resync asked of every live rankd", zap.Int("ranks", n), zap.String("index_id", c.idx.ID()))
}
