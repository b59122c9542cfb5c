package campaign

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Proxy is a TCP proxy between one daemon and NATS that understands the
// NATS client protocol's framing: it can drop, duplicate or reorder whole
// message frames (PUB, HPUB from the client; MSG, HMSG from the server),
// stall a direction, and cut every connection. Control frames (CONNECT,
// INFO, SUB, PING, ...) always pass unchanged, in order.
type Proxy struct {
	log      *zap.Logger
	upstream string
	ln       net.Listener
	wg       sync.WaitGroup

	// mu guards the following.
	mu     sync.Mutex
	conns  map[*proxyConn]struct{}
	closed bool
	// per direction: frames still to drop, duplicate, reorder.
	drop, dup, reorder [2]int
	armedAt            [2]time.Time // when the pending frame faults were armed
	stallUntil         [2]time.Time

	// Counters. Armed frame faults that no frame met within ArmTTL expire
	// (Expired); Dropped, Duplicated and Reordered count frames hit.

	Frames, Dropped, Duplicated, Reordered, Cuts, Expired atomic.Int64
}

type proxyConn struct {
	client, server net.Conn
}

// NewProxy listens on listen and forwards every connection to upstream.
func NewProxy(listen, upstream string, log *zap.Logger) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("proxy listen %s: %w", listen, err)
	}
	p := &Proxy{log: log, upstream: upstream, ln: ln, conns: map[*proxyConn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's listen address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.DialTimeout("tcp", p.upstream, 2*time.Second)
		if err != nil {
			p.log.Debug("proxy: upstream unreachable", zap.String("upstream", p.upstream), zap.Error(err))
			c.Close()
			continue
		}
		pc := &proxyConn{client: c, server: s}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			s.Close()
			return
		}
		p.conns[pc] = struct{}{}
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pump(pc, 0, c, s)
		go p.pump(pc, 1, s, c)
	}
}

// ArmTTL is how long an armed frame fault waits for a message frame. Arms
// do not pile up: a new arm of a kind replaces a pending one (the larger
// count wins), so a quiet connection is not hit by a backlog of faults.
const ArmTTL = 2 * time.Second

// ReorderHold is the longest a reordered frame waits for a successor to
// overtake it; then it goes out alone (delayed).
const ReorderHold = 100 * time.Millisecond

// Inject arms a frame fault on direction dir: drop or duplicate the next n
// message frames, or reorder the next one behind its successor.
func (p *Proxy) Inject(k Kind, dir, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expireLocked(dir)
	switch k {
	case NATSDrop:
		p.drop[dir] = max(p.drop[dir], n)
	case NATSDup:
		p.dup[dir] = max(p.dup[dir], n)
	case NATSReorder:
		p.reorder[dir] = 1
	}
	p.armedAt[dir] = time.Now()
}

func (p *Proxy) expireLocked(dir int) {
	if p.armedAt[dir].IsZero() || time.Since(p.armedAt[dir]) < ArmTTL {
		return
	}
	p.Expired.Add(int64(p.drop[dir] + p.dup[dir] + p.reorder[dir]))
	p.drop[dir], p.dup[dir], p.reorder[dir] = 0, 0, 0
	p.armedAt[dir] = time.Time{}
}

// Stall holds every frame of direction dir for d.
func (p *Proxy) Stall(dir int, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if u := time.Now().Add(d); u.After(p.stallUntil[dir]) {
		p.stallUntil[dir] = u
	}
}

// Cut closes every current connection (the daemon reconnects).
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pc := range p.conns {
		pc.client.Close()
		pc.server.Close()
	}
	p.Cuts.Add(1)
}

// Heal disarms every pending fault.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.drop, p.dup, p.reorder, p.stallUntil = [2]int{}, [2]int{}, [2]int{}, [2]time.Time{}
}

// Close stops the proxy and closes its connections; it waits for its
// goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	for pc := range p.conns {
		pc.client.Close()
		pc.server.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}

// action decides what happens to the next message frame of dir.
func (p *Proxy) action(dir int) (drop, dup, reorder bool, stall time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d := time.Until(p.stallUntil[dir]); d > 0 {
		stall = d
	}
	p.expireLocked(dir)
	switch {
	case p.drop[dir] > 0:
		p.drop[dir]--
		return true, false, false, stall
	case p.dup[dir] > 0:
		p.dup[dir]--
		return false, true, false, stall
	case p.reorder[dir] > 0:
		p.reorder[dir]--
		return false, false, true, stall
	}
	return false, false, false, stall
}

func (p *Proxy) stallOf(dir int) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return time.Until(p.stallUntil[dir])
}

type frameMsg struct {
	b   []byte
	msg bool
}

// pump forwards from -> to for one direction: a reader goroutine parses
// frames, this loop applies the faults and writes (so a reordered frame
// can go out on a timer when no successor comes).
func (p *Proxy) pump(pc *proxyConn, dir int, from, to net.Conn) {
	defer p.wg.Done()
	stop := make(chan struct{})
	frames := make(chan frameMsg, 64)
	defer func() {
		close(stop)
		pc.client.Close()
		pc.server.Close()
		p.mu.Lock()
		delete(p.conns, pc)
		p.mu.Unlock()
	}()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(frames)
		r := bufio.NewReaderSize(from, 64<<10)
		for {
			b, msg, err := ReadFrame(r)
			if err != nil {
				return
			}
			select {
			case frames <- frameMsg{b, msg}:
			case <-stop:
				return
			}
		}
	}()
	var held []byte // a frame being reordered behind the next one
	var flush <-chan time.Time
	for {
		var fm frameMsg
		var ok bool
		select {
		case fm, ok = <-frames:
			if !ok {
				if held != nil {
					_, _ = to.Write(held)
				}
				return
			}
		case <-flush:
			flush = nil
			if _, err := to.Write(held); err != nil {
				return
			}
			held = nil
			continue
		}
		if !fm.msg {
			if d := p.stallOf(dir); d > 0 {
				time.Sleep(d)
			}
			if _, err := to.Write(fm.b); err != nil {
				return
			}
			continue
		}
		p.Frames.Add(1)
		drop, dup, reorder, stall := p.action(dir)
		if stall > 0 {
			time.Sleep(stall)
		}
		var out []byte
		switch {
		case drop:
			p.Dropped.Add(1)
		case reorder && held == nil:
			held = fm.b
			flush = time.After(ReorderHold)
			p.Reordered.Add(1)
			continue
		case dup:
			p.Duplicated.Add(1)
			out = append(append(out, fm.b...), fm.b...)
		default:
			out = fm.b
		}
		if held != nil {
			out = append(out, held...)
			held, flush = nil, nil
		}
		if len(out) > 0 {
			if _, err := to.Write(out); err != nil {
				return
			}
		}
	}
}

// errFrame is a frame the proxy cannot parse.
var errFrame = errors.New("campaign: malformed NATS frame")

// ReadFrame reads one NATS protocol frame: a control line, and for PUB,
// HPUB, MSG and HMSG the payload and its CRLF. msg reports a message frame.
func ReadFrame(r *bufio.Reader) (frame []byte, msg bool, err error) {
	line, err := r.ReadBytes('\n')
	if err != nil {
		return nil, false, err
	}
	f := bytes.Fields(line)
	if len(f) == 0 {
		return line, false, nil
	}
	op := string(bytes.ToUpper(f[0]))
	var minFields int
	switch op {
	case "PUB":
		minFields = 3 // PUB subj [reply] size
	case "HPUB":
		minFields = 4 // HPUB subj [reply] hdr total
	case "MSG":
		minFields = 4 // MSG subj sid [reply] size
	case "HMSG":
		minFields = 5 // HMSG subj sid [reply] hdr total
	default:
		return line, false, nil
	}
	if len(f) < minFields {
		return nil, false, fmt.Errorf("%w: %s line has %d fields, want >= %d", errFrame, op, len(f), minFields)
	}
	n, err := strconv.Atoi(string(f[len(f)-1]))
	if err != nil || n < 0 || n > 64<<20 {
		return nil, false, fmt.Errorf("%w: %s payload size %q", errFrame, op, f[len(f)-1])
	}
	frame = make([]byte, len(line)+n+2)
	copy(frame, line)
	if _, err := io.ReadFull(r, frame[len(line):]); err != nil {
		return nil, false, err
	}
	return frame, true, nil
}

// proxySet is one daemon's proxies, one per NATS server of the cluster:
// a fault armed on the set is armed on each, so it hits whichever
// connection the daemon holds.
type proxySet []*Proxy

// Inject arms the frame fault on every proxy of the set.
func (s proxySet) Inject(k Kind, dir, n int) {
	for _, p := range s {
		p.Inject(k, dir, n)
	}
}

// Stall stalls direction dir of every proxy of the set for d.
func (s proxySet) Stall(dir int, d time.Duration) {
	for _, p := range s {
		p.Stall(dir, d)
	}
}

// Cut closes every connection of every proxy of the set.
func (s proxySet) Cut() {
	for _, p := range s {
		p.Cut()
	}
}

// Heal disarms every proxy of the set.
func (s proxySet) Heal() {
	for _, p := range s {
		p.Heal()
	}
}

// Close closes every proxy of the set.
func (s proxySet) Close() {
	for _, p := range s {
		p.Close()
	}
}
