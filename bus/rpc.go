package bus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// Connect dials NATS with reconnects that never give up and a name that
// shows in the server's connection list; opts add credentials
// (auth.ClientOptions, Creds.Options) and TLS. url may list several
// servers, comma-separated (a cluster): the client connects to one of
// them and, when it dies, moves to another (also to servers the cluster
// announced since), keeping its subscriptions.
func Connect(url, name string, opts ...nats.Option) (*nats.Conn, error) {
	nc, err := nats.Connect(url, append([]nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		// With several servers (a cluster), a client whose server dies
		// tries the others at once; these only space the rounds over a
		// list whose every server is down. The jitter keeps the clients
		// of a dead server from arriving in lockstep; the TLS one is
		// below nats.go's default of 1 s so a move stays under 2 s.
		nats.ReconnectWait(100 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, 250*time.Millisecond),
		nats.Timeout(5 * time.Second),
		// A server cut off by a partition (no RST, no FIN) is noticed
		// after 3 unanswered pings, 3-4 s, and left for another server
		// (nats.go's default is 2 min).
		nats.PingInterval(time.Second),
		nats.MaxPingsOutstanding(3),
	}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", url, err)
	}
	return nc, nil
}

// MaxRequestBytes bounds a decoded JSON request.
const MaxRequestBytes = 8 << 20

// Raw is a request body that Call sends as it is (a binary request such
// as wire.RetrieveRequest's MarshalBinary), not encoded as JSON.
type Raw []byte

// Call sends req as JSON (a Raw as it is) to subject and decodes the
// wire.Reply. A reply with an error comes back as a *wire.Error.
func Call[Resp any](ctx context.Context, nc *nats.Conn, subject string, req any) (*Resp, error) {
	var data []byte
	if raw, ok := req.(Raw); ok {
		data = raw
	} else {
		var err error
		if data, err = json.Marshal(req); err != nil {
			return nil, fmt.Errorf("encode request for %s: %w", subject, err)
		}
	}
	msg, err := nc.RequestWithContext(ctx, subject, data)
	if err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	var rep wire.Reply[Resp]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return nil, fmt.Errorf("decode reply from %s: %w", subject, errors.Join(err, wire.ErrMalformed))
	}
	if rep.Error != nil {
		return nil, rep.Error
	}
	if rep.OK == nil {
		return nil, fmt.Errorf("reply from %s has neither ok nor error: %w", subject, wire.ErrMalformed)
	}
	return rep.OK, nil
}

// Respond sends a successful reply.
func Respond[T any](msg *nats.Msg, v *T) error {
	data, err := json.Marshal(wire.Reply[T]{OK: v})
	if err != nil {
		return RespondError(msg, wire.CodeInternal, "encode reply: "+err.Error())
	}
	return msg.Respond(data)
}

// RespondError sends an error reply with a stable code.
func RespondError(msg *nats.Msg, code, message string) error {
	data, _ := json.Marshal(wire.Reply[struct{}]{Error: &wire.Error{Code: code, Message: message}})
	return msg.Respond(data)
}

// Decode unmarshals a JSON request strictly: unknown fields and oversize
// bodies are errors that name the problem.
func Decode(msg *nats.Msg, v any) error {
	if len(msg.Data) > MaxRequestBytes {
		return fmt.Errorf("request of %d bytes exceeds %d: %w", len(msg.Data), MaxRequestBytes, wire.ErrMalformed)
	}
	dec := json.NewDecoder(bytes.NewReader(msg.Data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decode %s request: %w", msg.Subject, errors.Join(err, wire.ErrMalformed))
	}
	if dec.More() {
		return fmt.Errorf("decode %s request: trailing data: %w", msg.Subject, wire.ErrMalformed)
	}
	return nil
}

// FetchInventory requests a rank's inventory page by page on subject (see
// wire.InventoryRequest): page 0 of a new snapshot, then the remaining
// pages of that snapshot, and assembles them. pageSize 0 uses the rank's
// default. perPage > 0 bounds each page request on top of ctx. Any error
// reply, timeout or page that does not belong to the snapshot fails the
// whole fetch.
func FetchInventory(ctx context.Context, nc *nats.Conn, subject string, pageSize int, perPage time.Duration) (*wire.Inventory, error) {
	return FetchInventoryBounded(ctx, nc, subject, pageSize, perPage, 0, 0)
}

// ErrInventoryTooLarge: an inventory declares more pages or objects than
// the caller's bound.
var ErrInventoryTooLarge = errors.New("inventory over the bound")

// FetchInventoryBounded is FetchInventory that gives up, with an error
// wrapping ErrInventoryTooLarge, as soon as the snapshot declares more
// than maxPages pages or its pages hold more than maxObjects objects (0:
// no bound), so a lying rank cannot make the caller fetch or hold more.
func FetchInventoryBounded(ctx context.Context, nc *nats.Conn, subject string, pageSize int, perPage time.Duration,
	maxPages, maxObjects int) (*wire.Inventory, error) {
	call := func(req wire.InventoryRequest) (*wire.InventoryPage, error) {
		cctx, cancel := ctx, context.CancelFunc(func() {})
		if perPage > 0 {
			cctx, cancel = context.WithTimeout(ctx, perPage)
		}
		defer cancel()
		return Call[wire.InventoryPage](cctx, nc, subject, req)
	}
	first, err := call(wire.InventoryRequest{PageSize: pageSize})
	if err != nil {
		return nil, err
	}
	if first.Pages < 1 || first.Snapshot == "" {
		return nil, fmt.Errorf("inventory page 0 from %s declares %d pages and snapshot %q: %w",
			subject, first.Pages, first.Snapshot, wire.ErrMalformed)
	}
	if maxPages > 0 && first.Pages > maxPages {
		return nil, fmt.Errorf("inventory from %s declares %d pages, limit %d: %w", subject, first.Pages, maxPages, ErrInventoryTooLarge)
	}
	objects := len(first.Objects)
	tooMany := func() error {
		if maxObjects > 0 && objects > maxObjects {
			return fmt.Errorf("inventory from %s holds more than %d objects (%d in its first pages), limit %d: %w",
				subject, maxObjects, objects, maxObjects, ErrInventoryTooLarge)
		}
		return nil
	}
	if err := tooMany(); err != nil {
		return nil, err
	}
	pages := make([]wire.InventoryPage, 1, min(first.Pages, 1024))
	pages[0] = *first
	for i := 1; i < first.Pages; i++ {
		p, err := call(wire.InventoryRequest{Snapshot: first.Snapshot, Page: i, PageSize: pageSize})
		if err != nil {
			return nil, fmt.Errorf("inventory page %d of %d (snapshot %q): %w", i, first.Pages, first.Snapshot, err)
		}
		objects += len(p.Objects)
		if err := tooMany(); err != nil {
			return nil, err
		}
		pages = append(pages, *p)
	}
	inv, err := wire.AssembleInventory(pages)
	if err != nil {
		return nil, fmt.Errorf("inventory from %s: %w", subject, err)
	}
	return &inv, nil
}
