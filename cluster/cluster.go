package cluster

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Cluster is this process's membership in the kvtier cluster: one
// memberlist node plus the table and event stream built from its callbacks.
//
// Lifecycle: New, then Start (binds and runs), then Join (contacts seeds).
// Leave announces a graceful exit; Shutdown stops everything. Shutdown
// without Leave looks like a crash to the others, who declare this member
// dead. Both are idempotent; Shutdown returns once every goroutine this
// package started has exited.
type Cluster struct {
	cfg    Config
	id     string
	log    *zap.Logger
	bridge *logBridge
	met    *metrics
	queue  *eventQueue
	stop   chan struct{} // closed by Shutdown
	wg     sync.WaitGroup

	meta atomic.Pointer[[]byte] // encoded local Meta, served to memberlist

	lifeMu  sync.RWMutex // guards the following; held (R) across memberlist calls so Shutdown waits for them
	ml      *memberlist.Memberlist
	started bool
	closed  bool
	left    atomic.Bool // set by the first Leave; UpdateMeta is refused from then on

	leaveMu sync.Mutex // serializes Leave, so a second call waits for the first's announcement

	updMu     sync.Mutex // serializes UpdateMeta and Leave's Meta.Leaving; guards localMeta
	localMeta Meta

	ackMu sync.Mutex  // guards acks
	acks  chan string // IDs of members that acknowledged our leaving message; nil outside announceLeave

	mu      sync.Mutex // guards the following; taken inside memberlist callbacks, never held across a memberlist call
	members map[string]*Member
	leaving map[string]time.Time // member IDs that announced their leave (leave.go), and when
	shut    bool                 // callbacks after Shutdown are ignored
	warned  map[string]struct{}  // rejected member IDs already logged

	// lose, when set (tests only), makes this member drop parts of leave
	// announcements, as a network fault would: the leaving message
	// (what = kindLeaving) or the alive messages carrying Meta.Leaving
	// (what = "meta") of member id, when it returns true.
	lose atomic.Pointer[func(what, id string) bool]

	subMu      sync.Mutex // guards the following
	subs       map[*Subscription]struct{}
	subsClosed bool
}

// New validates cfg and builds a Cluster. It does not touch the network.
// A zero cfg.Meta.Incarnation is replaced by NewIncarnation(); a nil Logger
// by zap.NewNop().
func New(cfg Config) (*Cluster, error) {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Meta.Incarnation == 0 {
		cfg.Meta.Incarnation = NewIncarnation()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Seeds = append([]string(nil), cfg.Seeds...)
	cfg.SecretKey = append([]byte(nil), cfg.SecretKey...)
	keys := make([][]byte, 0, len(cfg.SecondaryKeys))
	for _, k := range cfg.SecondaryKeys {
		keys = append(keys, append([]byte(nil), k...))
	}
	cfg.SecondaryKeys = keys
	cfg.Meta = cfg.Meta.clone()
	b, err := cfg.Meta.Encode()
	if err != nil {
		return nil, err
	}
	c := &Cluster{
		cfg:       cfg,
		id:        memberID(cfg.NodeName, cfg.Meta.Incarnation),
		met:       newMetrics(),
		queue:     newEventQueue(),
		stop:      make(chan struct{}),
		localMeta: cfg.Meta,
		members:   make(map[string]*Member),
		leaving:   make(map[string]time.Time),
		warned:    make(map[string]struct{}),
		subs:      make(map[*Subscription]struct{}),
	}
	c.meta.Store(&b)
	c.log = cfg.Logger.Named("cluster").With(zap.String("member", c.id))
	c.bridge = newLogBridge(c.log.Named("memberlist"))
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(c.met); err != nil {
			return nil, fmt.Errorf("register cluster metrics: %w", err)
		}
	}
	return c, nil
}

// Start binds the gossip port and starts the failure detector and the event
// goroutine. This member is then a cluster of one until Join or until
// another member joins it.
func (c *Cluster) Start() error {
	c.lifeMu.Lock()
	defer c.lifeMu.Unlock()
	if c.closed {
		return fmt.Errorf("start %s: %w", c.id, ErrClosed)
	}
	if c.started {
		return fmt.Errorf("start %s: %w", c.id, ErrStarted)
	}
	mc := c.cfg.memberlistConfig(c.id, &delegate{c: c}, c.bridge)
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("start memberlist %s on %s:%d: %w", c.id, c.cfg.BindAddr, c.cfg.BindPort, err)
	}
	c.ml = ml
	c.started = true
	c.wg.Add(1)
	go c.run()
	local := c.LocalMember()
	c.log.Info("cluster member started", zap.String("addr", local.Addr),
		zap.String("role", string(c.cfg.Meta.Role)), zap.Bool("encrypted", len(c.cfg.SecretKey) > 0))
	return nil
}

// Join contacts seeds (Config.Seeds when none are given) and merges state
// with every one it reaches. It retries every Config.JoinRetry until at
// least one seed answers, ctx ends (ErrJoin, wrapping the last failure) or
// the Cluster shuts down (ErrClosed). It returns the number of seeds
// reached. With no seeds at all it returns 0, nil: this member starts the
// cluster.
func (c *Cluster) Join(ctx context.Context, seeds ...string) (int, error) {
	if len(seeds) == 0 {
		seeds = c.cfg.Seeds
	}
	if len(seeds) == 0 {
		return 0, nil
	}
	var last error
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			if last != nil {
				err = fmt.Errorf("%w (last failure: %w)", err, last)
			}
			return 0, fmt.Errorf("join %s via %s after %d attempts: %w: %w",
				c.id, strings.Join(seeds, ","), attempt-1, ErrJoin, err)
		}
		n, err := c.joinOnce(seeds)
		if n > 0 {
			c.log.Info("joined cluster", zap.Int("seeds_reached", n), zap.Strings("seeds", seeds))
			return n, nil
		}
		if errorsIsLifecycle(err) {
			return 0, err
		}
		last = err
		if attempt&(attempt-1) == 0 { // attempts 1, 2, 4, 8...: a down seed must not flood the log
			c.log.Warn("join attempt failed", zap.Int("attempt", attempt), zap.Strings("seeds", seeds), zap.Error(err))
		}
		t := time.NewTimer(c.cfg.JoinRetry)
		select {
		case <-ctx.Done():
		case <-c.stop:
			t.Stop()
			return 0, fmt.Errorf("join %s: %w", c.id, ErrClosed)
		case <-t.C:
		}
		t.Stop()
	}
}

func (c *Cluster) joinOnce(seeds []string) (int, error) {
	c.lifeMu.RLock()
	defer c.lifeMu.RUnlock()
	if err := c.usable("join"); err != nil {
		return 0, err
	}
	return c.ml.Join(seeds)
}

// lifecycleError marks errors of the Cluster's own state.
type lifecycleError struct{ error }

func (e lifecycleError) Unwrap() error { return e.error }

func errorsIsLifecycle(err error) bool {
	_, ok := err.(lifecycleError)
	return ok
}

// usable checks that memberlist is running. Call with lifeMu held.
func (c *Cluster) usable(op string) error {
	switch {
	case c.closed:
		return lifecycleError{fmt.Errorf("%s %s: %w", op, c.id, ErrClosed)}
	case !c.started:
		return lifecycleError{fmt.Errorf("%s %s: %w", op, c.id, ErrNotStarted)}
	}
	return nil
}

// UpdateMeta changes this member's Meta and gossips it (memberlist
// UpdateNode): update edits a copy; NATS and the usage counters may
// change, the identity fields and Leaving may not (ErrMeta; Leave sets
// Leaving). After Leave it returns ErrClosed. The new Meta is in effect
// locally at once; UpdateMeta then waits until it has been sent to at least
// one peer, for at most Config.BroadcastTimeout or ctx's deadline if sooner
// (ErrTimeout; gossip keeps spreading it). Before Start it only sets the Meta
// that Start will announce.
func (c *Cluster) UpdateMeta(ctx context.Context, update func(m *Meta)) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("update meta of %s: %w", c.id, err)
	}
	c.lifeMu.RLock()
	defer c.lifeMu.RUnlock()
	if c.closed {
		return fmt.Errorf("update meta of %s: %w", c.id, ErrClosed)
	}
	c.updMu.Lock()
	defer c.updMu.Unlock()
	// Checked under updMu: Leave sets left before it takes updMu to set
	// Meta.Leaving, so no update can follow (and undo) that one.
	if c.left.Load() {
		return fmt.Errorf("update meta of %s after it left: %w", c.id, ErrClosed)
	}
	next := c.localMeta.clone()
	update(&next)
	if f := sameIdentity(&c.localMeta, &next); f != "" {
		return fmt.Errorf("meta %s is fixed for an incarnation (restart to change it): %w", f, ErrMeta)
	}
	if next.Leaving != c.localMeta.Leaving {
		return fmt.Errorf("meta leaving is set only by Leave, UpdateMeta cannot change it: %w", ErrMeta)
	}
	b, err := next.Encode()
	if err != nil {
		return err
	}
	c.localMeta = next
	c.meta.Store(&b)
	if !c.started {
		return nil
	}
	timeout := c.cfg.BroadcastTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = max(time.Until(dl), time.Millisecond) // memberlist waits forever on <= 0
	}
	if err := c.ml.UpdateNode(timeout); err != nil {
		return fmt.Errorf("update meta of %s within %v: %w: %w", c.id, timeout, ErrTimeout, err)
	}
	return nil
}

// Leave announces a graceful exit, then leaves, all within timeout
// (Config.BroadcastTimeout when timeout <= 0). From its start UpdateMeta is
// refused. It first announces the leave (leave.go): it tells every alive
// member directly and waits for each to acknowledge, and gossips
// Meta.Leaving, for at most half of timeout. Then it has memberlist
// broadcast the leave and waits, for the rest of timeout, until that has
// reached at least one peer; ErrTimeout otherwise.
//
// Members that got the announcement report this member as left, not dead.
// A member the announcement did not reach (logged at Warn) reports it dead:
// the safe direction, its owner fences at once. The member keeps gossiping
// until Shutdown, which should follow; Shutdown may then wait up to
// DetectorConfig.TCPTimeout for an announcement still dialing an unreachable
// member. Idempotent: a later call waits for the first one's announcement
// and does not repeat it.
func (c *Cluster) Leave(timeout time.Duration) error {
	c.lifeMu.RLock()
	defer c.lifeMu.RUnlock()
	if err := c.usable("leave"); err != nil {
		return err
	}
	if timeout <= 0 {
		timeout = c.cfg.BroadcastTimeout
	}
	c.leaveMu.Lock()
	defer c.leaveMu.Unlock()
	start := time.Now()
	if !c.left.Swap(true) {
		c.announceLeave(start.Add(timeout / 2))
	}
	rest := max(timeout-time.Since(start), time.Millisecond) // memberlist waits forever on <= 0
	if err := c.ml.Leave(rest); err != nil {
		return fmt.Errorf("leave %s within %v: %w: %w", c.id, timeout, ErrTimeout, err)
	}
	c.log.Info("left cluster")
	return nil
}

// Shutdown stops gossip and probing without announcing anything (the others
// will declare this member dead unless Leave came first), stops the event
// goroutine, closes every Subscription and unregisters the metrics. It
// returns when all of this package's goroutines have exited. Idempotent;
// the Cluster cannot be restarted.
func (c *Cluster) Shutdown() error {
	c.lifeMu.Lock()
	if c.closed {
		c.lifeMu.Unlock()
		return nil
	}
	c.closed = true
	ml := c.ml
	c.lifeMu.Unlock()

	var err error
	if ml != nil {
		if err = ml.Shutdown(); err != nil {
			err = fmt.Errorf("shut down memberlist %s: %w", c.id, err)
		}
	}
	c.mu.Lock()
	c.shut = true
	c.mu.Unlock()
	c.queue.close()
	close(c.stop)
	c.wg.Wait()

	c.subMu.Lock()
	c.subsClosed = true
	for s := range c.subs {
		close(s.ch)
		delete(c.subs, s)
	}
	c.subMu.Unlock()
	c.bridge.close()
	if c.cfg.Registerer != nil {
		c.cfg.Registerer.Unregister(c.met)
	}
	c.log.Info("cluster member shut down")
	return err
}

// Subscribe returns a Subscription for the events from now on, with a
// channel of the given capacity (Config.EventBuffer when buffer <= 0). To
// start from a consistent view, subscribe first, then read Members. After
// Shutdown the channel is already closed.
func (c *Cluster) Subscribe(buffer int) *Subscription {
	if buffer <= 0 {
		buffer = c.cfg.EventBuffer
	}
	s := &Subscription{ch: make(chan Event, buffer), c: c}
	c.subMu.Lock()
	defer c.subMu.Unlock()
	if c.subsClosed {
		close(s.ch)
		return s
	}
	c.subs[s] = struct{}{}
	return s
}

func (c *Cluster) unsubscribe(s *Subscription) {
	c.subMu.Lock()
	defer c.subMu.Unlock()
	if _, ok := c.subs[s]; ok {
		delete(c.subs, s)
		close(s.ch)
	}
}

// Members returns a snapshot of every member this node knows, itself
// included, sorted by ID: alive ones, and dead or left ones until
// DetectorConfig.GossipToTheDeadTime after their end.
func (c *Cluster) Members() []Member {
	c.mu.Lock()
	out := make([]Member, 0, len(c.members))
	for _, m := range c.members {
		mm := *m
		mm.Meta = m.Meta.clone()
		out = append(out, mm)
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// LocalMember returns this member as the others see it. Before Start, Addr
// is empty and State is zero.
func (c *Cluster) LocalMember() Member {
	c.mu.Lock()
	m, ok := c.members[c.id]
	var out Member
	if ok {
		out = *m
	}
	c.mu.Unlock()
	if !ok {
		c.updMu.Lock()
		out = Member{Name: c.cfg.NodeName, ID: c.id, Local: true, Meta: c.localMeta}
		c.updMu.Unlock()
	}
	out.Meta = out.Meta.clone()
	return out
}

// run is the event goroutine: it fans queued events out to subscriptions
// and forgets long-dead members.
func (c *Cluster) run() {
	defer c.wg.Done()
	reap := time.NewTicker(time.Second)
	defer reap.Stop()
	for {
		select {
		case <-c.queue.signal:
			c.dispatch(c.queue.take())
		case now := <-reap.C:
			c.reap(now)
		case <-c.stop:
			c.dispatch(c.queue.take())
			return
		}
	}
}

func (c *Cluster) dispatch(evs []Event) {
	for _, ev := range evs {
		c.logEvent(ev)
		var dropped int
		c.subMu.Lock()
		for s := range c.subs {
			s.seq++
			ev.Seq = s.seq
			select {
			case s.ch <- ev:
			default:
				s.dropped.Add(1)
				dropped++
			}
		}
		c.subMu.Unlock()
		if dropped > 0 {
			c.met.dropped.Add(float64(dropped))
			c.log.Warn("membership event dropped: subscriber buffer full",
				zap.Stringer("event", ev.Type), zap.String("id", ev.Member.ID), zap.Int("subscribers", dropped))
		}
	}
}

func (c *Cluster) logEvent(ev Event) {
	fields := []zap.Field{
		zap.String("id", ev.Member.ID), zap.String("addr", ev.Member.Addr),
		zap.String("role", string(ev.Member.Meta.Role)), zap.Uint64("incarnation", ev.Member.Meta.Incarnation),
	}
	switch ev.Type {
	case EventDead:
		c.log.Warn("member declared dead", fields...)
	case EventUpdate:
		c.log.Debug("member meta updated", fields...)
	default:
		c.log.Info("member "+ev.Type.String(), fields...)
	}
}

// reap forgets members dead or left for longer than GossipToTheDeadTime,
// as memberlist does, and leave announcements older than that of members it
// does not know (any more).
func (c *Cluster) reap(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, m := range c.members {
		if m.State != StateAlive && !m.Local && now.Sub(m.Since) > c.cfg.Detector.GossipToTheDeadTime {
			delete(c.members, id)
		}
	}
	for id, at := range c.leaving {
		if _, ok := c.members[id]; !ok && now.Sub(at) > c.cfg.Detector.GossipToTheDeadTime {
			delete(c.leaving, id)
		}
	}
	c.updateGaugeLocked()
}

func (c *Cluster) updateGaugeLocked() {
	var n [StateLeft + 1]int
	for _, m := range c.members {
		if m.State <= StateLeft {
			n[m.State]++
		}
	}
	for s := StateAlive; s <= StateLeft; s++ {
		c.met.members.WithLabelValues(s.String()).Set(float64(n[s]))
	}
}

// observe records a memberlist callback in the table and queues its event.
// typ is EventJoin, EventUpdate, or EventDead for NotifyLeave, which becomes
// EventLeave when the member announced its leave (goneEventLocked). It runs
// on memberlist's goroutines with memberlist's node lock held: it takes only
// c.mu and never blocks beyond it.
func (c *Cluster) observe(typ EventType, n *memberlist.Node) {
	now := time.Now()
	meta, err := DecodeMeta(n.Meta)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shut {
		return
	}
	if typ == EventDead {
		typ = c.goneEventLocked(n.Name, meta, err == nil)
	}
	st := StateAlive
	switch typ {
	case EventDead:
		st = StateDead
	case EventLeave:
		st = StateLeft
	}
	m := Member{Name: nameOf(n.Name), ID: n.Name, Addr: n.Address(), State: st, Since: now, Meta: meta, Local: n.Name == c.id}
	if old, ok := c.members[n.Name]; ok {
		if old.State == st {
			m.Since = old.Since
		}
		if err != nil {
			m.Meta = old.Meta // keep the last good one
		}
	}
	if err != nil {
		c.log.Warn("member meta does not decode", zap.String("id", n.Name), zap.Error(err))
	}
	c.members[n.Name] = &m
	switch typ {
	case EventJoin:
		if !m.Local {
			c.met.joins.Inc()
		}
	case EventUpdate:
		c.met.updates.Inc()
	case EventLeave:
		c.met.leaves.Inc()
	case EventDead:
		c.met.deaths.Inc()
	}
	c.updateGaugeLocked()
	c.queue.push(Event{Type: typ, Member: m, At: now})
}

// rejectAlive counts and logs (once per member) an alive message memberlist
// is told to ignore.
func (c *Cluster) rejectAlive(id string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shut {
		return
	}
	c.met.rejected.Inc()
	if _, ok := c.warned[id]; ok {
		return
	}
	if len(c.warned) >= 1024 {
		clear(c.warned)
	}
	c.warned[id] = struct{}{}
	c.log.Warn("ignoring member with invalid meta or name", zap.String("id", id), zap.Error(err))
}

// nameOf returns the NodeName part of a member ID.
func nameOf(id string) string {
	if i := strings.LastIndexByte(id, '@'); i >= 0 {
		return id[:i]
	}
	return id
}

// delegate receives memberlist's callbacks; it keeps them off Cluster's
// exported method set.
type delegate struct{ c *Cluster }

var (
	_ memberlist.Delegate         = (*delegate)(nil)
	_ memberlist.EventDelegate    = (*delegate)(nil)
	_ memberlist.AliveDelegate    = (*delegate)(nil)
	_ memberlist.ConflictDelegate = (*delegate)(nil)
)

func (d *delegate) NodeMeta(limit int) []byte {
	b := *d.c.meta.Load()
	if len(b) > limit { // Encode enforces MaxMetaBytes; memberlist passes the same limit
		return nil
	}
	return b
}

func (d *delegate) NotifyMsg(b []byte)                         { d.c.handleUserMsg(b) }
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *delegate) LocalState(join bool) []byte                { return nil }
func (d *delegate) MergeRemoteState(buf []byte, join bool)     {}

// NotifyAlive admits a member only if its Meta decodes and validates and its
// name is NodeName@Meta.Incarnation.
func (d *delegate) NotifyAlive(peer *memberlist.Node) error {
	meta, err := DecodeMeta(peer.Meta)
	if lose := d.c.lose.Load(); err == nil && meta.Leaving && lose != nil && (*lose)("meta", peer.Name) {
		return fmt.Errorf("test: leaving meta of %s lost", peer.Name)
	}
	if err == nil {
		if want := memberID(nameOf(peer.Name), meta.Incarnation); peer.Name != want {
			err = fmt.Errorf("member name %q does not match its meta incarnation (want %q): %w", peer.Name, want, ErrMeta)
		}
	}
	if err != nil {
		d.c.rejectAlive(peer.Name, err)
	}
	return err
}

func (d *delegate) NotifyJoin(n *memberlist.Node)   { d.c.observe(EventJoin, n) }
func (d *delegate) NotifyUpdate(n *memberlist.Node) { d.c.observe(EventUpdate, n) }

// NotifyLeave is called for a leave and for a death alike (memberlist
// v0.7.0 does not tell them apart; see leave.go): observe decides.
func (d *delegate) NotifyLeave(n *memberlist.Node) { d.c.observe(EventDead, n) }

func (d *delegate) NotifyConflict(existing, other *memberlist.Node) {
	d.c.mu.Lock()
	defer d.c.mu.Unlock()
	if d.c.shut {
		return
	}
	d.c.log.Warn("two members claim one ID", zap.String("id", existing.Name),
		zap.String("existing_addr", existing.Address()), zap.String("other_addr", other.Address()))
}
