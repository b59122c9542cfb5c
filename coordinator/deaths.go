package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
)

// Confirming deaths (issues 28.2 and 29.4).
//
// Gossip is keyed with one key that every rankd host holds, so a gossip
// death or leave proves nothing: any key holder can send one encrypted
// "dead" packet for any rank, and memberlist declares live but CPU-starved
// processes dead when their probe answers come late. A rankd member that
// gossip reports dead or left is therefore only a suspect. The coordinator
// acts on it (fails the restores that expect that incarnation, fences its
// L1 placements, counts the reader as not alive) only when a channel that
// only the rank itself can speak on confirms it:
//
//   - leaving: the rank said so, with a heartbeat marked Leaving on its own
//     heartbeat subject (rankd's graceful shutdown sends it before its
//     gossip leave), or in the answer to a probe;
//   - nats_gone: a liveness probe (wire.InventoryRequest.Probe, on the
//     rank's inventory subject, which only the rank's identity may
//     subscribe to) got "no responders" from NATS: no connection of the
//     rank's identity is there. A process killed with -9 loses its TCP
//     connection at once, so this fences a real crash as soon as gossip
//     notices it;
//   - heartbeats_stopped: no heartbeat of that incarnation, nor a probe
//     answer from it, for Death.ConfirmBeats of its heartbeat intervals
//     (a host that is down or cut off keeps its NATS connection
//     half-open until NATS's own pings give up).
//
// A suspect that proves alive (a heartbeat or probe answer of that
// incarnation after the notice) is counted once in
// kvtier_coord_death_notices_unconfirmed_total{cause} and logged once; so
// is one that gossip shows alive again before anything confirmed it. A
// suspect whose rank reported a newer incarnation meanwhile is dropped
// (the new incarnation's first batch fenced the old one). The decision is
// judgeDeath, a pure function.
//
// The heartbeat table is per coordinator, and a replicated coordinator
// receives heartbeats only while it leads. So silence counts only from the
// moment this coordinator began watching (its first check as leader of
// the current term, or after start): a new leader confirms a death by
// silence no sooner than one window after it took over, while probes work
// at once. A coordinator that itself stalled for longer than
// deathStallAfter (a starved host) opens that grace again: heartbeats may
// wait unread in its buffers. Nor is a death confirmed by silence while
// heartbeats wait unhandled in this coordinator's subscription: it lags
// behind them, and the suspect's may be among them. Only the deciding
// coordinator (standalone,
// or the raft leader) probes and confirms; the others keep their suspects
// for when they lead.
//
// The inverse, a rank whose heartbeats stop while gossip still says alive
// (NATS cut off, gossip not), is not acted on: nothing authenticated says
// it died, its restores fail at their deadline (no report arrives), and
// engines cannot reach it over NATS either. It is what the coordinator did
// before.

// DeathConfig says how a gossip death or leave of a rankd is confirmed
// (deaths.go).
type DeathConfig struct {
	// ConfirmBeats: a gossip death or leave is confirmed once no heartbeat
	// of the rank's incarnation (nor a probe answer from it) arrived for
	// this many of its heartbeat intervals. Default 3 (6 s at rankd's
	// default 2 s). Higher tolerates longer stalls of a starved rankd;
	// lower fences a host that died without closing its connections
	// sooner. A kill -9 does not wait for it (its NATS connection closes:
	// nats_gone).
	ConfirmBeats int
	// AssumedInterval is the heartbeat interval assumed for a rank whose
	// heartbeats announce none (a rankd from before) or that this
	// coordinator has not heard from. Default 2 s (rankd's default).
	AssumedInterval time.Duration
	// ProbeTimeout bounds one liveness probe. Default 1 s. A probe that
	// times out proves nothing either way (a starved rank answers late);
	// the suspect is probed again every heartbeat interval.
	ProbeTimeout time.Duration
}

// DefaultDeathConfig returns the defaults above.
func DefaultDeathConfig() DeathConfig {
	return DeathConfig{ConfirmBeats: 3, AssumedInterval: 2 * time.Second, ProbeTimeout: time.Second}
}

// Validate checks the rules; the error names the rule and the numbers.
func (d DeathConfig) Validate() error {
	switch {
	case d.ConfirmBeats < 1:
		return fmt.Errorf("death confirm beats %d must be >= 1: %w", d.ConfirmBeats, ErrConfig)
	case d.AssumedInterval <= 0 || d.AssumedInterval > wire.MaxHeartbeatInterval:
		return fmt.Errorf("assumed heartbeat interval %v must be in (0, %v]: %w", d.AssumedInterval, wire.MaxHeartbeatInterval, ErrConfig)
	case d.ProbeTimeout <= 0:
		return fmt.Errorf("death probe timeout %v must be > 0: %w", d.ProbeTimeout, ErrConfig)
	}
	return nil
}

// What confirmed a death (label of kvtier_coord_death_notices_confirmed_total).
const (
	byLeaving = "leaving"
	byNATS    = "nats_gone"
	bySilence = "heartbeats_stopped"
)

// Notice causes (label of kvtier_coord_death_notices_unconfirmed_total):
// the gossip states, and the absent-rank sweeps (startup, leader).
const (
	causeGossipDead = "dead"
	causeGossipLeft = "left"
	causeStartup    = "startup"
	causeLeader     = "leader"
)

const (
	// deathTick is how often the suspects are judged (and re-probed when
	// due); events (a notice, a probe answer, a leaving heartbeat) judge
	// at once.
	deathTick = 200 * time.Millisecond
	// deathStallAfter: a check this late means the coordinator itself was
	// starved; silence counts again from then (see above).
	deathStallAfter = 2 * time.Second
	// maxProbes bounds the liveness probes in flight.
	maxProbes = 16
	// maxUnknownSuspects bounds the suspects of ranks the index does not
	// know (readers that never stored); those of known ranks are bounded
	// by MaxRanks.
	maxUnknownSuspects = 1024
)

// suspect is one rankd incarnation that gossip reports dead or left, or
// that a sweep found absent, not confirmed yet.
type suspect struct {
	rank   wire.Rank
	inc    uint64
	cause  string              // causeGossipDead | causeGossipLeft | causeStartup | causeLeader
	member string              // memberlist ID ("" for a sweep)
	state  cluster.MemberState // what gossip said (StateDead for a sweep)
	since  time.Time           // when the notice arrived
	sweep  bool                // from fenceAbsent, not from gossip
	// unindexed: the index did not hold this incarnation when the notice
	// came (capped at maxUnknownSuspects).
	unindexed bool

	// Proof over NATS, from heartbeats and probe answers of this
	// incarnation.
	lastAlive time.Time     // newest heartbeat or probe answer (zero: none)
	interval  time.Duration // announced heartbeat interval (0: none)
	leaving   bool          // the rank said it is leaving
	goneAt    time.Time     // a probe got "no responders" (zero: never)

	refuted   bool // proof of life after since: counted and logged
	probing   bool
	nextProbe time.Time
	// drainMark: when silence was first deferred for heartbeats queued
	// unhandled, the number of the last heartbeat then received (handled
	// plus queued, heartbeatBacklog); once the subscription has handed
	// out a later one, every heartbeat that could have excused the
	// silence has been handled (0: no deferral yet).
	drainMark int64
	drainSub  *nats.Subscription // the subscription drainMark counts in
}

type suspectKey struct {
	rank wire.Rank
	inc  uint64
}

// judgeDeath decides suspect s at now: what confirms its death, or "" to
// wait. watchSince is when this coordinator began receiving heartbeats
// (this term, or since its last stall); beats and assumed are
// DeathConfig.ConfirmBeats and AssumedInterval.
func judgeDeath(s *suspect, watchSince, now time.Time, beats int, assumed time.Duration) string {
	switch {
	case s.leaving:
		return byLeaving
	case !s.goneAt.IsZero() && s.goneAt.After(s.lastAlive):
		return byNATS
	}
	last := watchSince
	if s.lastAlive.After(last) {
		last = s.lastAlive
	}
	if now.Sub(last) >= time.Duration(beats)*heartbeatInterval(s.interval, assumed) {
		return bySilence
	}
	return ""
}

// heartbeatInterval is an announced interval, clamped, or assumed.
func heartbeatInterval(announced, assumed time.Duration) time.Duration {
	if announced <= 0 {
		return assumed
	}
	return min(max(announced, time.Millisecond), wire.MaxHeartbeatInterval)
}

// deaths holds the suspects and the watch of the current term.
type deaths struct {
	mu         sync.Mutex // guards the following
	suspects   map[suspectKey]*suspect
	term       context.Context // the decision term the watch belongs to
	watchSince time.Time
	lastCheck  time.Time     // when the previous check began
	lastTook   time.Duration // how long the previous check ran (its fences' commits)

	wake   chan struct{} // capacity 1: judge now
	probes chan struct{} // semaphore of maxProbes
	met    *deathMetrics
}

func newDeaths() *deaths {
	d := &deaths{suspects: make(map[suspectKey]*suspect), wake: make(chan struct{}, 1),
		probes: make(chan struct{}, maxProbes), met: newDeathMetrics()}
	d.met.n = d.count
	return d
}

func (d *deaths) poke() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// deathMetrics are the confirmation's counters.
type deathMetrics struct {
	unconfirmed *prometheus.CounterVec // by notice cause
	confirmed   *prometheus.CounterVec // by proof
	probes      *prometheus.CounterVec // by outcome
	suspects    prometheus.GaugeFunc
	stalls      prometheus.Counter
	queuedBeats prometheus.Counter
	ignored     prometheus.Counter
	gaps        prometheus.Histogram
	n           func() int
}

func newDeathMetrics() *deathMetrics {
	m := &deathMetrics{
		unconfirmed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_death_notices_unconfirmed_total",
			Help: "Gossip deaths or leaves of a rankd (or absent ranks found by a sweep) not acted on because the rank proved alive over NATS (a heartbeat or probe answer of that incarnation), or gossip showed it alive again first: a forged notice, a starved host or a gossip-only partition. By notice cause (dead, left, startup, leader).",
		}, []string{"cause"}),
		confirmed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_death_notices_confirmed_total",
			Help: "Gossip deaths or leaves of a rankd (or absent ranks) confirmed over NATS and acted on, by proof (leaving: the rank said so; nats_gone: no connection of its identity; heartbeats_stopped: silence for the confirmation window).",
		}, []string{"by"}),
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvtier_coord_death_probes_total",
			Help: "Liveness probes of suspected ranks, by outcome (alive, leaving, other_incarnation, gone, no_answer, refused).",
		}, []string{"outcome"}),
		ignored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_death_notices_ignored_total",
			Help: "Gossip deaths or leaves not even suspected: the table of suspects of incarnations the index does not know was full (1024).",
		}),
		gaps: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvtier_coord_heartbeat_gap_seconds",
			Help:    "Time between two heartbeats of one rank incarnation as received: compare its tail with Death.ConfirmBeats times the ranks' interval (a starved host stretches it; a gap over the window confirms a gossip death).",
			Buckets: []float64{0.25, 0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 15, 20, 30, 60},
		}),
		stalls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_death_check_stalls_total",
			Help: "Times the death check itself ran late by over 2 s (a starved coordinator); silence then counts from the stall's end.",
		}),
		queuedBeats: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvtier_coord_death_silence_deferred_total",
			Help: "Deaths by heartbeat silence not confirmed because heartbeats waited unread in this coordinator's subscription (it lags behind them); judged again at the next check, until the heartbeats queued at the first deferral are read.",
		}),
	}
	m.suspects = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvtier_coord_rank_suspects",
		Help: "Rankd incarnations gossip reports dead or left (or sweeps found absent) that are not confirmed over NATS yet.",
	}, func() float64 {
		if m.n == nil {
			return 0
		}
		return float64(m.n())
	})
	initLabels(m.unconfirmed, causeGossipDead, causeGossipLeft, causeStartup, causeLeader)
	initLabels(m.confirmed, byLeaving, byNATS, bySilence)
	initLabels(m.probes, "alive", "leaving", "other_incarnation", "gone", "no_answer", "refused")
	return m
}

func (m *deathMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.unconfirmed, m.confirmed, m.probes, m.suspects, m.stalls, m.queuedBeats, m.ignored, m.gaps}
}

func (m *deathMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

func (m *deathMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

// suspectMember makes a rankd member that gossip reports dead or left a
// suspect (membership.go).
func (c *Coordinator) suspectMember(m cluster.Member, cause string, at time.Time) {
	c.addSuspect(suspect{rank: memberRank(m), inc: m.Meta.Incarnation, cause: cause, member: m.ID, state: m.State, since: at})
}

// addSuspect records s unless that incarnation is suspected already (the
// first notice stands), seeded with what this coordinator heard from the
// rank before.
func (c *Coordinator) addSuspect(s suspect) {
	ri, known := c.idx.Rank(s.rank)
	beat, beatOK := c.hb.lastBeat(s.rank)
	d := c.deaths
	k := suspectKey{s.rank, s.inc}
	d.mu.Lock()
	if _, ok := d.suspects[k]; ok {
		d.mu.Unlock()
		return
	}
	// Incarnations the index knows are bounded by MaxRanks; the others
	// (readers that never stored, or members claiming an incarnation that
	// never reported) by maxUnknownSuspects: a key holder inventing
	// members cannot grow the table without bound.
	s.unindexed = !known || ri.Incarnation != s.inc
	if s.unindexed {
		n := 0
		for _, o := range d.suspects {
			if o.unindexed {
				n++
			}
		}
		if n >= maxUnknownSuspects {
			d.mu.Unlock()
			d.met.ignored.Inc()
			c.log.Warn("gossip death notice ignored: too many suspects of incarnations the index does not know",
				zap.Stringer("rank", s.rank), zap.Uint64("incarnation", s.inc), zap.Int("suspects", n))
			return
		}
	}
	if beatOK && beat.inc == s.inc {
		s.lastAlive, s.interval, s.leaving = beat.at, beat.interval, beat.leaving
	}
	d.suspects[k] = &s
	d.mu.Unlock()
	d.poke()
	c.log.Info("rank reported gone; acting only once its NATS heartbeats or connection confirm it",
		zap.Stringer("rank", s.rank), zap.Uint64("incarnation", s.inc), zap.String("cause", s.cause),
		zap.String("member", s.member))
}

// aliveInGossip ends the suspicion of an incarnation gossip shows alive
// again (a refuted false death, a healed partition).
func (c *Coordinator) aliveInGossip(r wire.Rank, inc uint64) {
	d := c.deaths
	k := suspectKey{r, inc}
	d.mu.Lock()
	s, ok := d.suspects[k]
	if ok {
		delete(d.suspects, k)
	}
	d.mu.Unlock()
	if !ok {
		return
	}
	if !s.refuted {
		d.met.unconfirmed.WithLabelValues(s.cause).Inc()
	}
	c.log.Info("suspected rank alive in gossip again; nothing was fenced", zap.Stringer("rank", r), zap.Uint64("incarnation", inc),
		zap.String("cause", s.cause), zap.Duration("suspected_for", time.Since(s.since)))
}

// provedAlive records a heartbeat or probe answer of rank r's incarnation
// inc at now (interval 0: none announced).
func (c *Coordinator) provedAlive(r wire.Rank, inc uint64, now time.Time, interval time.Duration, leaving bool, via string) {
	d := c.deaths
	d.mu.Lock()
	s, ok := d.suspects[suspectKey{r, inc}]
	if !ok {
		d.mu.Unlock()
		return
	}
	if now.After(s.lastAlive) {
		s.lastAlive = now
		// A new silence, if one follows, waits for its own backlog: the
		// mark of the last deferral counted heartbeats this one is among.
		s.drainMark = 0
	}
	if interval > 0 {
		s.interval = interval
	}
	s.leaving = s.leaving || leaving
	refuted := !s.refuted && !s.leaving && !now.Before(s.since)
	if refuted {
		s.refuted = true
	}
	cp := *s
	d.mu.Unlock()
	if leaving {
		d.poke()
	}
	if refuted {
		d.met.unconfirmed.WithLabelValues(cp.cause).Inc()
		c.log.Warn("rank reported gone, but it is alive over NATS: not fencing (a forged notice, a starved host, or gossip cut off)",
			zap.Stringer("rank", r), zap.Uint64("incarnation", inc), zap.String("cause", cp.cause), zap.String("member", cp.member),
			zap.String("proof", via), zap.Duration("after_notice", now.Sub(cp.since)))
	}
}

// deathLoop judges the suspects until the coordinator stops.
func (c *Coordinator) deathLoop() {
	t := time.NewTicker(deathTick)
	defer t.Stop()
	for {
		select {
		case <-c.ctx.Done():
			return
		case <-t.C:
		case <-c.deaths.wake:
		}
		c.checkSuspects(time.Now())
	}
}

// deathOutcome is one suspect's outcome of a check.
type deathOutcome struct {
	s  suspect
	by string // "" superseded
}

// checkSuspects judges every suspect at now; it acts only where this
// coordinator decides.
func (c *Coordinator) checkSuspects(now time.Time) {
	d := c.deaths
	// The index's incarnations first: no index lock under d.mu.
	d.mu.Lock()
	ranks := make(map[wire.Rank]uint64, len(d.suspects))
	for k := range d.suspects {
		ranks[k.rank] = 0
	}
	d.mu.Unlock()
	for r := range ranks {
		if ri, ok := c.idx.Rank(r); ok {
			ranks[r] = ri.Incarnation
		}
	}
	if !c.repl.decides() {
		// A follower keeps its suspects for when it leads, but not those a
		// newer incarnation superseded (the table stays bounded).
		d.mu.Lock()
		d.lastCheck = time.Time{}
		for k := range d.suspects {
			if ranks[k.rank] > k.inc {
				delete(d.suspects, k)
			}
		}
		d.mu.Unlock()
		return
	}
	term := c.repl.term()
	// Heartbeats delivered to this coordinator but not handled yet may
	// include the suspect's: its silence is then this coordinator's lag.
	queued, handed, hbSub := c.heartbeatBacklog()

	d.mu.Lock()
	if late, took := d.advanceWatchLocked(term, now); late > 0 {
		d.met.stalls.Inc()
		c.log.Warn("the death check ran late (the coordinator was starved, or the check before waited that long on a fence's commit); heartbeat silence counts from now",
			zap.Duration("late_by", late), zap.Duration("previous_check_took", took))
	}
	var acts []deathOutcome
	var probe []suspectKey
	for k, s := range d.suspects {
		if idxInc := ranks[k.rank]; idxInc > k.inc {
			delete(d.suspects, k)
			acts = append(acts, deathOutcome{s: *s})
			continue
		}
		by := judgeDeath(s, d.watchSince, now, c.cfg.Death.ConfirmBeats, c.cfg.Death.AssumedInterval)
		if by == bySilence && s.probing {
			by = "" // a probe in flight may still prove it alive (a starved rank answers late)
		}
		if by == bySilence && queued > 0 {
			// Deferred until the heartbeats queued at the first deferral
			// are handled, not while any are queued: a rank identity
			// flooding its own heartbeat subject (C9 lets it publish
			// there) would otherwise keep the backlog from emptying and
			// every death by silence unconfirmed.
			switch {
			case s.drainMark == 0 || s.drainSub != hbSub:
				// (a new subscription, after a leadership change,
				// counts from zero: the old mark means nothing there)
				s.drainMark, s.drainSub = handed+int64(queued), hbSub
				by = ""
			case handed <= s.drainMark:
				by = ""
			}
			if by == "" {
				d.met.queuedBeats.Inc()
			}
		}
		if by != "" {
			delete(d.suspects, k)
			acts = append(acts, deathOutcome{s: *s, by: by})
			continue
		}
		if !s.probing && !now.Before(s.nextProbe) {
			select {
			case d.probes <- struct{}{}:
				s.probing = true
				s.nextProbe = now.Add(heartbeatInterval(s.interval, c.cfg.Death.AssumedInterval))
				probe = append(probe, k)
			default: // too many in flight: next check
			}
		}
	}
	d.mu.Unlock()

	for _, k := range probe {
		if !c.goroutines.Go("liveness-probe", func() { c.probeRank(k) }) {
			// Shutdown has begun: give the probe slot back and leave the
			// suspect marked probing, so silence alone cannot confirm its
			// death in the moments before this loop stops.
			<-d.probes
		}
	}
	// Sweeps after gossip notices, each in rank order: a stable log.
	sort.Slice(acts, func(i, j int) bool {
		a, b := acts[i].s, acts[j].s
		if a.sweep != b.sweep {
			return !a.sweep
		}
		if a.rank != b.rank {
			return a.rank.String() < b.rank.String()
		}
		return a.inc < b.inc
	})
	for _, a := range acts {
		if a.by == "" {
			c.supersededSuspect(a.s)
			continue
		}
		c.confirmDeath(a.s, a.by, now)
	}
	d.mu.Lock()
	d.checkEndedLocked(term, now, time.Now())
	d.mu.Unlock()
}

// advanceWatchLocked moves the silence watch for a check at now (d.mu
// held): a new decision term (a new raft leadership; standalone, the
// first check) starts it, and so does a check more than deathStallAfter
// after the previous one (this coordinator was starved, heartbeats may sit
// unread). It returns how late a stalled check was, 0 when not stalled,
// and how long the check before it ran.
//
// The gap counts from the previous check's start, so a check that waited
// seconds on a fence's commit also restarts the watch: whether the process
// was starved meanwhile (heartbeats unread) cannot be told from here, and
// restarting only delays a confirmation. The warning names the previous
// check's time so that a reader can tell a slow commit from starvation.
func (d *deaths) advanceWatchLocked(term context.Context, now time.Time) (late, took time.Duration) {
	took = d.lastTook
	switch {
	case term != d.term:
		d.term, d.watchSince = term, now
	case !d.lastCheck.IsZero() && now.Sub(d.lastCheck) > deathStallAfter:
		d.watchSince = now
		late = now.Sub(d.lastCheck) - deathTick
	}
	d.lastCheck, d.lastTook = now, 0
	return late, took
}

// checkEndedLocked records how long the check that began at start ran
// (d.mu held), unless another check or term began meanwhile.
func (d *deaths) checkEndedLocked(term context.Context, start, end time.Time) {
	if term != d.term || !d.lastCheck.Equal(start) {
		return
	}
	d.lastTook = end.Sub(start)
}

// probeRank sends one liveness probe to the suspect's rank.
func (c *Coordinator) probeRank(k suspectKey) {
	d := c.deaths
	defer func() { <-d.probes }()
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.Death.ProbeTimeout)
	defer cancel()
	req, _ := json.Marshal(wire.InventoryRequest{Probe: true}) // a struct of plain fields always marshals
	msg, err := c.nc.RequestWithContext(ctx, c.subj.Inventory(k.rank), req)
	now := time.Now()
	outcome := "no_answer"
	var p wire.RankProbe
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		outcome = "gone"
	case err != nil:
	default:
		var rep wire.Reply[wire.RankProbe]
		if json.Unmarshal(msg.Data, &rep) != nil || rep.OK == nil {
			outcome = "refused" // a rankd from before: its identity is there, its incarnation unknown
		} else if p = *rep.OK; p.Rank != k.rank || p.Incarnation != k.inc {
			outcome = "other_incarnation"
		} else if p.Leaving {
			outcome = "leaving"
		} else {
			outcome = "alive"
		}
	}
	d.met.probes.WithLabelValues(outcome).Inc()
	switch outcome {
	case "alive", "leaving":
		c.provedAlive(k.rank, k.inc, now, 0, p.Leaving, "probe")
	case "gone":
		d.mu.Lock()
		if s, ok := d.suspects[k]; ok {
			s.goneAt = now
		}
		d.mu.Unlock()
	}
	d.mu.Lock()
	if s, ok := d.suspects[k]; ok {
		s.probing = false
	}
	d.mu.Unlock()
	if outcome == "gone" {
		d.poke()
	}
	if err != nil && outcome == "no_answer" && c.ctx.Err() == nil {
		c.log.Debug("liveness probe unanswered", zap.Stringer("rank", k.rank), zap.Uint64("incarnation", k.inc), zap.Error(err))
	}
}

// supersededSuspect drops a suspect whose rank reported a newer
// incarnation: that incarnation's first batch fenced the old one, and the
// old one no longer counts as a reader.
func (c *Coordinator) supersededSuspect(s suspect) {
	if !s.sweep {
		c.live.markGone(s.rank, s.inc, s.state)
	}
	c.met.fenceSkips.Inc()
	c.log.Info("rank member gone, but a newer incarnation already reports; not fencing", zap.Stringer("rank", s.rank),
		zap.String("member", s.member), zap.Uint64("incarnation", s.inc), zap.String("cause", s.cause))
}

// confirmDeath acts on a confirmed suspect: the reader is no longer alive,
// the restores that expect that incarnation fail, its L1 placements are
// fenced (only the incarnation the index knows, issue 10.3).
func (c *Coordinator) confirmDeath(s suspect, by string, now time.Time) {
	c.deaths.met.confirmed.WithLabelValues(by).Inc()
	cause := s.cause
	state := s.state
	if by == byLeaving && !s.sweep {
		cause, state = causeGossipLeft, cluster.StateLeft
	}
	if !s.sweep {
		c.live.markGone(s.rank, s.inc, state)
	}
	if !c.repl.decides() {
		return // replicated: the leader fences (and a new leader sweeps)
	}
	log := c.log.With(zap.Stringer("rank", s.rank), zap.String("member", s.member), zap.String("cause", cause),
		zap.Uint64("incarnation", s.inc), zap.String("confirmed_by", by), zap.Duration("confirmed_after", now.Sub(s.since)))
	r := s.rank
	if s.sweep {
		if ri, ok := c.idx.Rank(r); !ok || ri.Fenced || ri.Incarnation != s.inc {
			log.Info("absent rank fenced or superseded meanwhile")
			return
		}
		c.rs.failRank(r, s.inc, cause, fmt.Sprintf("rank %s not in the cluster after the startup grace", r))
	} else {
		// Only restores that expect this very incarnation: one that
		// expects another is not read by the member that died.
		c.rs.failRankRange(r, s.inc, s.inc, cause, fmt.Sprintf("rank %s %s", r, cause))
	}
	ri, ok := c.idx.Rank(r)
	inc := ri.Incarnation
	switch {
	case !ok:
		log.Info("rank gone (confirmed); the index does not know the rank")
		return
	case inc == s.inc && ri.Fenced:
		// Fenced already: by an earlier leader (a suspect kept while this
		// coordinator followed), or by a new incarnation's batch.
		log.Info("rank gone (confirmed); already fenced")
		return
	case inc > s.inc:
		c.met.fenceSkips.Inc()
		log.Info("rank gone (confirmed), but a newer incarnation already reports; not fencing", zap.Uint64("current_incarnation", inc))
		return
	case inc < s.inc:
		// A newer incarnation that never reported (a forged or confused
		// member claiming the rank) fences nothing; a real restart's new
		// incarnation fences the old one with its first batch.
		c.met.fenceSkips.Inc()
		log.Warn("death of an incarnation that never reported; not fencing the one the index knows",
			zap.Uint64("current_incarnation", inc))
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
	defer cancel()
	n, err := c.repl.fenceRank(ctx, r, s.inc)
	if err != nil {
		switch {
		case errors.Is(err, errNotLeader):
			log.Warn("rank not fenced: leadership lost; the new leader's sweep fences it", zap.Error(err))
		case errors.Is(err, context.Canceled) || c.ctx.Err() != nil:
			log.Warn("rank not fenced: coordinator stopping", zap.Error(err))
		default:
			c.met.internal.Inc()
			log.Error("fence rank failed; its L1 placements may still be served", zap.Error(err))
		}
		return
	}
	c.kvRankChanged(r, nil)
	took := time.Since(s.since)
	c.met.fences.WithLabelValues(cause).Inc()
	c.met.fenced.Add(float64(n))
	c.met.fenceSeconds.Observe(took.Seconds())
	switch {
	case s.sweep:
		log.Warn("rank not alive in the cluster after the grace (confirmed); L1 placements fenced",
			zap.Int("l1_placements", n), zap.Duration("grace", c.cfg.StartupFenceGrace))
	case cause == causeGossipLeft:
		log.Warn("rank left; its L1 placements fenced", zap.Int("l1_placements", n), zap.Duration("since_notification", took))
	default:
		log.Warn("dead rank fenced", zap.Int("l1_placements", n), zap.Duration("since_notification", took))
	}
}

// count is the number of suspects (the gauge).
func (d *deaths) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.suspects)
}
