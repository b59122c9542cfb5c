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

// MaxRequestBytes bounds a decoded request, JSON or binary (the
// coordinator's decodeRequest checks its binary forms against it too).
const MaxRequestBytes = 8 << 20

// Raw is a request body that Call sends as it is (a binary request such
// as wire.RetrieveRequest's MarshalBinary), not encoded as JSON.
type Raw []byte

// Headed is a request body sent with NATS headers (wire.HeaderDeadline):
// Call sends Body as it would send it alone, with Header.
type Headed struct {
	Header nats.Header
	Body   any
}

// Call sends req as JSON (a Raw as it is; a Headed's body with its
// headers) to subject and decodes the wire.Reply. A reply with an error
// comes back as a *wire.Error.
func Call[Resp any](ctx context.Context, nc *nats.Conn, subject string, req any) (*Resp, error) {
	var hdr nats.Header
	if h, ok := req.(Headed); ok {
		hdr, req = h.Header, h.Body
	}
	var data []byte
	if raw, ok := req.(Raw); ok {
		data = raw
	} else {
		var err error
		if data, err = json.Marshal(req); err != nil {
			return nil, fmt.Errorf("encode request for %s: %w", subject, err)
		}
	}
	var msg *nats.Msg
	var err error
	if hdr != nil {
		msg, err = nc.RequestMsgWithContext(ctx, &nats.Msg{Subject: subject, Header: hdr, Data: data})
	} else {
		msg, err = nc.RequestWithContext(ctx, subject, data)
	}
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
