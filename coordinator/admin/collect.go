package admin

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// CollectRaft asks every coordinator on nc for its raft state (admin.raft,
// one request, one reply per coordinator) and returns the replies that
// arrive within window, sorted by id; none (nil) from a cluster without
// raft.
func CollectRaft(ctx context.Context, nc *nats.Conn, subj wire.Subjects, window time.Duration) ([]wire.AdminRaftNode, error) {
	out, err := collect[wire.AdminRaftNode](ctx, nc, subj.Admin(wire.AdminRaft), window)
	slices.SortFunc(out, func(a, b wire.AdminRaftNode) int { return strings.Compare(a.ID, b.ID) })
	return out, err
}

// collect sends one request on subject and gathers the replies of every
// coordinator that arrive within window.
func collect[T any](ctx context.Context, nc *nats.Conn, subject string, window time.Duration) ([]T, error) {
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w: %w", inbox, ErrCollect, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(subject, inbox, []byte("{}")); err != nil {
		return nil, fmt.Errorf("request %s: %w: %w", subject, ErrCollect, err)
	}
	deadline := time.Now().Add(window)
	var out []T
	for {
		left := time.Until(deadline)
		if left <= 0 || ctx.Err() != nil {
			return out, nil
		}
		msg, err := sub.NextMsg(left)
		if err != nil {
			return out, nil // the window closed (or no responders)
		}
		var rep wire.Reply[T]
		if err := json.Unmarshal(msg.Data, &rep); err != nil || rep.OK == nil {
			continue
		}
		out = append(out, *rep.OK)
	}
}

// CollectRaftVerify asks every coordinator to verify its index and digest
// its state (admin.raft.verify) and returns the replies that arrive within
// window, sorted by id.
func CollectRaftVerify(ctx context.Context, nc *nats.Conn, subj wire.Subjects, window time.Duration) ([]wire.AdminRaftVerifyReply, error) {
	out, err := collect[wire.AdminRaftVerifyReply](ctx, nc, subj.Admin(wire.AdminRaftVerify), window)
	slices.SortFunc(out, func(a, b wire.AdminRaftVerifyReply) int { return strings.Compare(a.ID, b.ID) })
	return out, err
}

// ReplicasAgree reports whether every replica's index verified clean and
// replicas at the same raft index have the same digest; the error names
// the first disagreement.
func ReplicasAgree(reps []wire.AdminRaftVerifyReply) error {
	at := map[uint64]wire.AdminRaftVerifyReply{}
	for _, r := range reps {
		if !r.Verify.OK {
			return fmt.Errorf("replica %s: index verification found %d problems: %w: %w", r.ID, len(r.Verify.Mismatches), ErrReplicas, index.ErrInconsistent)
		}
		if o, ok := at[r.RaftIndex]; ok && o.Digest != r.Digest {
			return fmt.Errorf("replicas %s and %s at raft index %d hold different states (digest %.12s vs %.12s): %w: %w",
				o.ID, r.ID, r.RaftIndex, o.Digest, r.Digest, ErrReplicas, index.ErrInconsistent)
		}
		at[r.RaftIndex] = r
	}
	return nil
}

// WriteRaftVerifyTable writes one row per replica.
func WriteRaftVerifyTable(w io.Writer, reps []wire.AdminRaftVerifyReply) error {
	t := newTable(w, "RAFT_ID", "OK", "RAFT_INDEX", "PLACEMENTS", "CHUNKS", "DIGEST")
	for _, r := range reps {
		t.row(r.ID, yes(r.Verify.OK), u64(r.RaftIndex), i64(r.Verify.Placements), i64(r.Verify.Chunks), r.Digest[:min(16, len(r.Digest))])
	}
	return t.flush()
}
