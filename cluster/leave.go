package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Telling a graceful leave from a death.
//
// memberlist calls NotifyLeave both when a member leaves and when it is
// declared dead, and v0.7.0 does not say which: the State of the *Node it
// passes is never filled in (memberlist keeps the real state private;
// hashicorp/memberlist issues #266 and #293). So a leaving member says so
// itself, through memberlist's public API, before it calls memberlist's
// Leave:
//
//  1. It tells every member it sees alive, with a leaving message sent by
//     SendReliable (TCP). A receiver records the announcement under the
//     leaver's member ID (NodeName@Incarnation: one process start) and
//     acknowledges with an ack message, sent back the same way.
//  2. It sets Meta.Leaving and gossips it (UpdateNode), waiting until
//     memberlist has sent the update its usual number of times. This reaches
//     members the direct message missed (one that joined meanwhile, or one
//     the leaver cannot dial), and tells every subscriber early through an
//     EventUpdate.
//  3. It waits until every member of step 1 has acknowledged, a send failed,
//     or half of Leave's timeout has passed; then it calls memberlist's Leave
//     with the rest.
//
// NotifyLeave then reports a leave (EventLeave, StateLeft) for a member that
// announced, directly or through its last Meta, and a death otherwise.
//
// Why an acknowledgement: SendReliable returns once the bytes are written
// to the socket, not once the receiver has handled them, and memberlist
// handles stream messages and the gossiped leave on different goroutines.
// Without the ack, a receiver could process the leave before the
// announcement and report a death; with it, every member that acknowledged
// recorded the announcement before the leave was sent.
//
// Failure directions. A member that gets neither the message nor the Meta
// before it learns of the leave (unreachable for the whole announcement, or
// running a kvtier from before this protocol) reports a death: the safe
// direction, its owner fences the leaver's L1 placements at once, as it does
// for a leave. A member that announced and then crashed before or during
// memberlist's Leave is reported left: it had already committed to exit
// (Leave cannot be undone), and the coordinator fences both alike.

// leaveMsgVersion is the version of the leave messages' encoding.
const leaveMsgVersion = 1

// maxLeaveMsgBytes bounds an encoded leave message: two member IDs (each at
// most 128 + 1 + 20 bytes) and a few keys.
const maxLeaveMsgBytes = 512

// Kinds of leave message.
const (
	kindLeaving = "leaving" // From is about to leave.
	kindAck     = "ack"     // From recorded To's leaving message.
)

// leaveMsg is the only memberlist user message kvtier sends: a JSON object.
type leaveMsg struct {
	V    int    `json:"v"`
	Kind string `json:"k"`
	// From is the sender's member ID.
	From string `json:"from"`
	// To is the leaver's member ID in an ack; empty in a leaving message.
	To string `json:"to,omitempty"`
}

func (m leaveMsg) encode() []byte {
	m.V = leaveMsgVersion
	b, err := json.Marshal(m)
	if err != nil { // a struct of strings always marshals
		panic(fmt.Sprintf("encode leave message: %v", err))
	}
	return b
}

// decodeLeaveMsg parses and validates a leave message. Bad input gives an
// error, never a panic.
func decodeLeaveMsg(b []byte) (leaveMsg, error) {
	if len(b) > maxLeaveMsgBytes {
		return leaveMsg{}, fmt.Errorf("leave message is %d B, over %d B: %w", len(b), maxLeaveMsgBytes, errMessage)
	}
	var m leaveMsg
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&m); err != nil {
		return leaveMsg{}, fmt.Errorf("decode leave message: %w: %w", errMessage, err)
	}
	if dec.More() {
		return leaveMsg{}, fmt.Errorf("decode leave message: trailing data after the object: %w", errMessage)
	}
	if m.V != leaveMsgVersion {
		return leaveMsg{}, fmt.Errorf("leave message version %d, want %d: %w", m.V, leaveMsgVersion, errMessage)
	}
	if err := checkMemberID("from", m.From); err != nil {
		return leaveMsg{}, err
	}
	switch m.Kind {
	case kindLeaving:
		if m.To != "" {
			return leaveMsg{}, fmt.Errorf("leaving message names a recipient %q: %w", m.To, errMessage)
		}
	case kindAck:
		if err := checkMemberID("to", m.To); err != nil {
			return leaveMsg{}, err
		}
	default:
		return leaveMsg{}, fmt.Errorf("leave message kind %q must be %q or %q: %w", m.Kind, kindLeaving, kindAck, errMessage)
	}
	return m, nil
}

// checkMemberID checks that id has the shape of memberID's result.
func checkMemberID(field, id string) error {
	name, inc, ok := strings.Cut(id, "@")
	if !ok || name == "" || len(name) > 128 || strings.ContainsAny(name, " \t\r\n") {
		return fmt.Errorf("%s %q must be a member ID, name@incarnation with a name of 1 to 128 B: %w", field, id, errMessage)
	}
	if _, err := strconv.ParseUint(inc, 10, 64); err != nil {
		return fmt.Errorf("%s %q: incarnation must be a decimal uint64: %w", field, id, errMessage)
	}
	return nil
}

// nodeAt builds the memberlist node to send to from a member ID and its
// host:port gossip address (Member.Addr).
func nodeAt(id, addr string) (*memberlist.Node, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("address %q of %s: %w", addr, id, err)
	}
	ip := net.ParseIP(host)
	p, err := strconv.ParseUint(port, 10, 16)
	if ip == nil || err != nil {
		return nil, fmt.Errorf("address %q of %s must be ip:port", addr, id)
	}
	return &memberlist.Node{Name: id, Addr: ip, Port: uint16(p)}, nil
}

// announceLeave runs steps 1 to 3 of the protocol above, until by at the
// latest. Leave calls it once, with lifeMu held (R) and c.left already set,
// so UpdateMeta can no longer change the Meta.
func (c *Cluster) announceLeave(by time.Time) {
	start := time.Now()
	type peer struct{ id, addr string }
	var peers []peer
	c.mu.Lock()
	c.leaving[c.id] = start // our own view reports our leave as a leave too
	for id, m := range c.members {
		if !m.Local && m.State == StateAlive {
			peers = append(peers, peer{id, m.Addr})
		}
	}
	c.mu.Unlock()

	// Step 1. Acks are collected from here on; failed sends too.
	acks := make(chan string, len(peers))
	c.ackMu.Lock()
	c.acks = acks
	c.ackMu.Unlock()
	defer func() {
		c.ackMu.Lock()
		c.acks = nil
		c.ackMu.Unlock()
	}()
	failed := make(chan string, len(peers))
	msg := leaveMsg{Kind: kindLeaving, From: c.id}.encode()
	ml := c.ml
	for _, p := range peers {
		node, err := nodeAt(p.id, p.addr)
		if err != nil {
			c.log.Warn("cannot announce leave", zap.String("to", p.id), zap.Error(err))
			failed <- p.id
			continue
		}
		// Tracked by wg: a send to an unreachable member can outlive Leave
		// by up to DetectorConfig.TCPTimeout (SendReliable's dial timeout),
		// and Shutdown waits for it. lifeMu (R) is held, so Shutdown has
		// not begun waiting.
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			if err := ml.SendReliable(node, msg); err != nil {
				c.log.Debug("leave announcement not delivered", zap.String("to", p.id), zap.Error(err))
				failed <- p.id
			}
		}()
	}

	// Step 2.
	c.updMu.Lock()
	next := c.localMeta.clone()
	next.Leaving = true
	if b, err := next.Encode(); err != nil {
		// Only a Meta within 15 B of the size limit: the direct messages
		// still announce the leave.
		c.log.Warn("cannot gossip leaving in meta", zap.Error(err))
	} else {
		c.localMeta = next
		c.meta.Store(&b)
		if err := ml.UpdateNode(max(time.Until(by), time.Millisecond)); err != nil { // memberlist waits forever on <= 0
			c.log.Warn("leaving meta not gossiped before the announcement deadline", zap.Error(err))
		}
	}
	c.updMu.Unlock()

	// Step 3.
	pending := make(map[string]struct{}, len(peers))
	for _, p := range peers {
		pending[p.id] = struct{}{}
	}
	var unreachable []string
	timer := time.NewTimer(max(time.Until(by), 0))
	defer timer.Stop()
wait:
	for len(pending) > 0 {
		select {
		case id := <-acks:
			delete(pending, id)
		case id := <-failed:
			if _, ok := pending[id]; ok {
				delete(pending, id)
				unreachable = append(unreachable, id)
			}
		case <-timer.C:
			break wait
		}
	}
	silent := make([]string, 0, len(pending))
	for id := range pending {
		silent = append(silent, id)
	}
	slices.Sort(silent)
	slices.Sort(unreachable)
	took := zap.Duration("took", time.Since(start))
	if len(unreachable)+len(silent) > 0 {
		c.log.Warn("leave announcement not acknowledged by every member; unless they saw the leaving meta, they will report this member dead",
			zap.Int("members", len(peers)), zap.Strings("unreachable", unreachable), zap.Strings("no_ack", silent), took)
		return
	}
	c.log.Debug("leave announced", zap.Int("members", len(peers)), took)
}

// handleUserMsg handles a memberlist user message (NotifyMsg). It runs on
// memberlist's goroutines and never blocks: an ack is sent by a goroutine of
// its own.
func (c *Cluster) handleUserMsg(b []byte) {
	m, err := decodeLeaveMsg(b)
	if err != nil {
		c.log.Warn("ignoring cluster message", zap.Error(err))
		return
	}
	switch m.Kind {
	case kindLeaving:
		c.gotLeaving(m.From)
	case kindAck:
		if m.To != c.id {
			return // for an earlier process on this address
		}
		c.ackMu.Lock()
		acks := c.acks
		c.ackMu.Unlock()
		if acks != nil {
			select {
			case acks <- m.From:
			default: // a duplicate ack; the buffer holds one per peer
			}
		}
	}
}

// gotLeaving records that member id announced its leave and starts the
// acknowledgement.
func (c *Cluster) gotLeaving(id string) {
	if id == c.id {
		return
	}
	if lose := c.lose.Load(); lose != nil && (*lose)(kindLeaving, id) {
		return
	}
	c.mu.Lock()
	if c.shut {
		c.mu.Unlock()
		return
	}
	if _, ok := c.leaving[id]; !ok {
		c.leaving[id] = time.Now()
	}
	m, known := c.members[id]
	var addr string
	if known {
		addr = m.Addr
		c.wg.Add(1) // before Shutdown's Wait: shut is set under mu before it
	}
	c.mu.Unlock()
	if !known {
		// The leaver knows us but we do not know it yet: the announcement
		// counts, but there is no address to acknowledge to, and the leaver
		// waits out its announcement deadline.
		c.log.Info("unknown member announced its leave", zap.String("id", id))
		return
	}
	c.log.Debug("member announced its leave", zap.String("id", id))
	go c.sendAck(id, addr)
}

// sendAck acknowledges id's leaving message.
func (c *Cluster) sendAck(id, addr string) {
	defer c.wg.Done()
	node, err := nodeAt(id, addr)
	if err != nil {
		c.log.Warn("cannot acknowledge leave announcement", zap.String("to", id), zap.Error(err))
		return
	}
	msg := leaveMsg{Kind: kindAck, From: c.id, To: id}.encode()
	c.lifeMu.RLock()
	defer c.lifeMu.RUnlock()
	if c.closed || !c.started {
		return
	}
	if err := c.ml.SendReliable(node, msg); err != nil {
		// The announcement is recorded all the same; the leaver waits out
		// its deadline.
		c.log.Warn("cannot acknowledge leave announcement", zap.String("to", id), zap.Error(err))
	}
}

// goneEventLocked is the event for a member memberlist reports gone
// (NotifyLeave): a leave if it announced one, directly or through its Meta
// (meta, when it decoded, or the last good one in the table), a death
// otherwise. Call with c.mu held.
func (c *Cluster) goneEventLocked(id string, meta Meta, metaOK bool) EventType {
	if _, ok := c.leaving[id]; ok {
		return EventLeave
	}
	if metaOK && meta.Leaving {
		return EventLeave
	}
	if old, ok := c.members[id]; ok && old.Meta.Leaving {
		return EventLeave
	}
	return EventDead
}
