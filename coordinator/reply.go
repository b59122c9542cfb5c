package coordinator

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
)

// Replies (C8, STYLE 22). Every answer the coordinator sends goes through
// reply or replyError: the send is counted in kvtier_coord_replies_total
// by operation and outcome, and a send that fails is logged. A successful
// reply whose encoding exceeds the connection's max payload is never
// attempted: the requester gets code too_large naming the encoded size and
// the limit instead, so a request never goes unanswered because its answer
// was too big. Handlers that create state for a reply (restore.begin)
// encode first with encodeReply and refuse before creating anything.

// Reply outcomes, the values of the outcome label.
const (
	replyOK         = "ok"          // a success reply was sent
	replyError      = "error"       // an error reply was sent
	replyTooLarge   = "too_large"   // the success reply did not fit; too_large sent instead
	replySendFailed = "send_failed" // the send itself failed (connection closed, ...)
	replyNoInbox    = "no_inbox"    // the request had no reply subject: nothing to send to
)

// errReplyTooLarge: an encoded reply exceeds the connection's max payload.
var errReplyTooLarge = errors.New("reply exceeds the NATS max payload")

// okReply is wire.Reply[T]{OK: v} for any T: the same JSON.
type okReply struct {
	OK any `json:"ok"`
}

// encodeReply encodes v as a successful wire.Reply and checks it against
// the connection's max payload; the error wraps errReplyTooLarge and names
// both numbers.
func (c *Coordinator) encodeReply(v any) ([]byte, error) {
	data, err := json.Marshal(okReply{OK: v})
	if err != nil {
		return nil, fmt.Errorf("encode reply: %w", err)
	}
	if lim := c.nc.MaxPayload(); int64(len(data)) > lim {
		return nil, fmt.Errorf("reply of %d B exceeds the NATS max payload of %d B: %w", len(data), lim, errReplyTooLarge)
	}
	return data, nil
}

// reply sends v as the successful answer to m for operation op. A reply
// that does not fit is answered with code too_large instead, one that does
// not encode with code internal. It reports whether the success reply was
// sent.
func (c *Coordinator) reply(op string, m *nats.Msg, v any) bool {
	if m.Reply == "" {
		c.met.replies.WithLabelValues(op, replyNoInbox).Inc()
		return false
	}
	data, err := c.encodeReply(v)
	if err != nil {
		c.replyUnsendable(op, m, err)
		return false
	}
	return c.sendReply(op, m, data, replyOK)
}

// replyUnsendable answers m when encodeReply failed: code too_large for a
// reply over the max payload, internal for one that does not encode.
func (c *Coordinator) replyUnsendable(op string, m *nats.Msg, err error) {
	if errors.Is(err, errReplyTooLarge) {
		c.refuseTooLarge(op, m, err)
		return
	}
	c.internalError(m, op, "encode reply", err)
}

// sendEncoded sends a successful reply already encoded (and checked) by
// encodeReply.
func (c *Coordinator) sendEncoded(op string, m *nats.Msg, data []byte) bool {
	if m.Reply == "" {
		c.met.replies.WithLabelValues(op, replyNoInbox).Inc()
		return false
	}
	return c.sendReply(op, m, data, replyOK)
}

// refuseTooLarge answers m with code too_large for a reply that did not
// fit, counted as outcome too_large.
func (c *Coordinator) refuseTooLarge(op string, m *nats.Msg, err error) {
	c.log.Warn("reply too large; refused", zap.String("op", op), zap.String("subject", m.Subject), zap.Error(err))
	c.sendError(op, m, wire.CodeTooLarge, err.Error(), replyTooLarge)
}

// replyError answers m with an error reply of code and message.
func (c *Coordinator) replyError(op string, m *nats.Msg, code, message string) bool {
	return c.sendError(op, m, code, message, replyError)
}

func (c *Coordinator) sendError(op string, m *nats.Msg, code, message, outcome string) bool {
	return c.sendErrorRetry(op, m, code, message, 0, outcome)
}

// sendErrorRetry is sendError with a retry hint (wire.Error.RetryAfterMS;
// 0: none).
func (c *Coordinator) sendErrorRetry(op string, m *nats.Msg, code, message string, retryMS int, outcome string) bool {
	if m.Reply == "" {
		c.met.replies.WithLabelValues(op, replyNoInbox).Inc()
		return false
	}
	data, err := json.Marshal(wire.Reply[struct{}]{Error: &wire.Error{Code: code, Message: message, RetryAfterMS: retryMS}})
	if err != nil { // cannot happen: strings always encode
		c.met.replies.WithLabelValues(op, replySendFailed).Inc()
		c.log.Error("encode error reply", zap.String("op", op), zap.Error(err))
		return false
	}
	if lim := c.nc.MaxPayload(); int64(len(data)) > lim {
		// A message naming thousands of items: keep the head, which names
		// the rule.
		keep := max(int(lim)-256, 0)
		message = fmt.Sprintf("%.*s... (error message of %d B cut to fit the max payload of %d B)",
			keep, message, len(message), lim)
		data, _ = json.Marshal(wire.Reply[struct{}]{Error: &wire.Error{Code: code, Message: message, RetryAfterMS: retryMS}})
	}
	return c.sendReply(op, m, data, outcome)
}

// sendReply sends data as the reply to m, counting outcome on success and
// send_failed (logged) on failure.
func (c *Coordinator) sendReply(op string, m *nats.Msg, data []byte, outcome string) bool {
	if err := m.Respond(data); err != nil {
		c.met.replies.WithLabelValues(op, replySendFailed).Inc()
		lvl := c.log.Error
		if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionDraining) {
			lvl = c.log.Warn
		}
		lvl("reply not sent", zap.String("op", op), zap.String("subject", m.Subject), zap.String("inbox", m.Reply),
			zap.Int("bytes", len(data)), zap.String("outcome", outcome), zap.Error(err))
		return false
	}
	c.met.replies.WithLabelValues(op, outcome).Inc()
	return outcome == replyOK
}

// startupRetryMS is the retry hint (wire.Error.RetryAfterMS) of the
// unavailable answers a coordinator gives while its index opens.
const startupRetryMS = 250
