package transfer

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/transfer/tier"
)

// CollectResult is tier.CollectResult: what one collection removed.
type CollectResult = tier.CollectResult

// l2Collector is implemented by tiers that can collect their garbage
// (FileTier).
type l2Collector interface {
	Collect(ctx context.Context, before time.Time) (CollectResult, error)
}

// collectL2 runs one collection of the tier's garbage older than
// L2CollectGrace, counted and logged.
func (e *Engine) collectL2() {
	c, ok := e.l2.(l2Collector)
	if !ok {
		return
	}
	res, err := c.Collect(e.life, e.cfg.Now().Add(-e.cfg.L2CollectGrace))
	e.ctr.l2CollectedQuarantine.Add(uint64(res.Quarantined))
	e.ctr.l2CollectedTemp.Add(uint64(res.Temp))
	e.ctr.l2CollectedOrphan.Add(uint64(res.Orphans))
	e.ctr.l2CollectedBytes.Add(res.Bytes)
	if err != nil && e.life.Err() == nil {
		e.log.Warn("L2 collection failed", zap.Error(err))
	}
	if n := res.Quarantined + res.Temp + res.Orphans; n > 0 {
		e.log.Info("L2 collected old files", zap.Int("quarantined", res.Quarantined), zap.Int("temp", res.Temp),
			zap.Int("orphans", res.Orphans), zap.Uint64("bytes", res.Bytes), zap.Duration("grace", e.cfg.L2CollectGrace))
	}
}

// collectLoop collects L2's garbage at start-up and every L2CollectEvery.
func (e *Engine) collectLoop() {
	e.collectL2()
	t := time.NewTicker(e.cfg.L2CollectEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			e.collectL2()
		case <-e.life.Done():
			return
		}
	}
}
