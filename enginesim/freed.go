package enginesim

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// waitFreed waits on sub (the rank's freed subject, subscribed before the
// store was sent) for the wire.BlocksFreed of the store of reqID and
// chunk: after a reply saying blocks_in_use, the engine may reuse the
// blocks or destroy the producer event only then (C10).
func waitFreed(ctx context.Context, sub *nats.Subscription, reqID string, chunk dcp.ChunkHash) error {
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return fmt.Errorf("waiting for the blocks of store %q to be freed: %w", reqID, err)
		}
		var bf wire.BlocksFreed
		if json.Unmarshal(m.Data, &bf) != nil || bf.RequestID != reqID {
			continue
		}
		for _, c := range bf.Chunks {
			if c == chunk {
				return nil
			}
		}
	}
}
