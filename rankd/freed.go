package rankd

import (
	"encoding/json"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/transfer"
	"github.com/kvtier/kvtier/wire"
)

// announceFreed follows a store answered with blocks_in_use: once the
// device has stopped reading the store's blocks (f.Released), it publishes
// wire.BlocksFreed on the rank's freed subject, so the engine knows when it
// may reuse them (C10). The wait is a goroutine of the daemon's group
// (d.goroutines, refused once Shutdown's last phase began) and ends at
// the latest when the engine closes, which cuts the device work short and
// releases every store.
func (d *Daemon) announceFreed(req *wire.StoreRequest, f *transfer.StoreFuture) {
	msg := wire.BlocksFreed{Rank: d.cfg.Rank, RequestID: req.RequestID, Namespace: req.Namespace,
		Chunks: make([]dcp.ChunkHash, len(req.Chunks))}
	for i, c := range req.Chunks {
		msg.Chunks[i] = c.Chunk
	}
	ok := d.goroutines.Go("blocks-freed", func() {
		select {
		case <-f.Released():
		case <-d.stop:
			// The engine closed before stop: every store is released.
			select {
			case <-f.Released():
			default:
				d.met.blocksFreed.WithLabelValues("failed").Inc()
				d.log.Error("blocks-freed message not sent: the store still held its blocks at shutdown", zap.String("request", req.RequestID))
				return
			}
		}
		p, err := json.Marshal(msg)
		d.mu.Lock()
		nc := d.nc
		d.mu.Unlock()
		if err == nil {
			err = nc.Publish(d.subj.Freed(d.cfg.Rank), p)
		}
		if err == nil {
			err = nc.Flush()
		}
		if err != nil {
			d.met.blocksFreed.WithLabelValues("failed").Inc()
			d.log.Error("blocks-freed message not sent", zap.String("request", req.RequestID), zap.Error(err))
			return
		}
		d.met.blocksFreed.WithLabelValues("sent").Inc()
		d.log.Info("blocks of a timed-out store are free again", zap.String("request", req.RequestID), zap.Int("chunks", len(msg.Chunks)))
	})
	if !ok {
		// Shutdown's last phase (the group closes with stopped): counted
		// and logged as lost, as before the group existed.
		d.met.blocksFreed.WithLabelValues("failed").Inc()
		d.log.Error("blocks-freed message not sent: the daemon is stopping", zap.String("request", req.RequestID))
	}
}
