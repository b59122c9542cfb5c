package rankd

import (
	"encoding/base64"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
)

// The index watch (issue 29.2). A coordinator restarted on a lost data
// directory starts a new index (a new random id, in its signed gossip
// metadata) and asks the ranks it sees live for their inventories. A rank
// it did not reach then (partitioned, its NATS connection down, a resync
// refused by the caps) would never be asked while it sends no events. So
// the rank watches the ids: when a coordinator gossips a verified id this
// process has not seen before (not at the first sight: the ids seen first
// are recorded), it offers its inventory in its heartbeats
// (wire.Heartbeat.OfferIndex) until it serves an inventory or
// indexOfferFor passes; the coordinator whose index has that id resyncs
// it. Nothing is taken from gossip but the id: the inventory goes through
// NATS, asked by the coordinator, under the rank's credential. An
// inventory request names the asking index (wire.HeaderIndex), and the
// rank records that id as seen: the usual case, a new coordinator asking
// every live rank at its start before gossip shows them its id, then
// makes no second offer (and no second resync hiding the rank's
// placements while it streams).
//
// An id is acted on only when the coordinator's signature over it
// (cluster.Meta.IndexSig, key from the credentials, as the NATS URLs)
// verifies; an unsigned or otherwise signed one is ignored and counted, so
// a gossip key holder cannot make every rank resync. A replayed old signed
// id is at most one offer, which the coordinator ignores (not its id).

// indexOfferFor bounds how long a rank offers its inventory to a new index
// without being asked for it.
const indexOfferFor = 2 * time.Minute

// maxSeenIndexes bounds the ids remembered (several coordinators, restarts).
const maxSeenIndexes = 64

// maxIndexIDBytes bounds an index id taken from an inventory request's
// header (a coordinator's is 32 hex digits).
const maxIndexIDBytes = 64

// maxServedIndexes bounds the ids of indexes that asked for the inventory.
const maxServedIndexes = 8

// indexWatch is the rank's view of the coordinators' index ids.
type indexWatch struct {
	changes   prometheus.Counter // new ids acted on
	untrusted prometheus.Counter // ids ignored: signature missing or bad

	mu         sync.Mutex // guards the following
	seen       []string   // ids seen, oldest first
	served     []string   // ids of indexes that asked for the inventory (wire.HeaderIndex), oldest first
	primed     bool       // a verified id was seen: later new ones are changes
	offer      string     // id offered in heartbeats; "" none
	offerUntil time.Time
	lastLog    time.Time // of an untrusted id
}

// initIndexWatch registers the watch's metrics.
func (d *Daemon) initIndexWatch() error {
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "kvtier", Subsystem: "rankd", Name: name, Help: help,
			ConstLabels: prometheus.Labels{"rank": d.cfg.Rank.String()}})
	}
	d.iw.changes = c("index_changes_total",
		"New coordinator index ids seen in signed gossip after the first (a coordinator restarted on a lost data directory): each makes the rank offer its inventory in its heartbeats.")
	d.iw.untrusted = c("untrusted_index_ids_total",
		"Gossiped coordinator index ids ignored because the coordinator's signature over them did not verify (checked every watch tick, 2/s per coordinator member).")
	for _, m := range []prometheus.Collector{d.iw.changes, d.iw.untrusted} {
		if err := d.met.reg.Register(m); err != nil {
			return err
		}
	}
	return nil
}

// watchIndex looks at the alive coordinators' index ids in members (one
// watch tick) and starts an offer when one is new.
func (d *Daemon) watchIndex(members []cluster.Member, now time.Time) {
	for _, m := range members {
		if m.Meta.Role != cluster.RoleCoordinator || m.State != cluster.StateAlive || m.Meta.Index == "" {
			continue
		}
		if err := d.verifyIndex(m); err != nil {
			d.iw.untrusted.Inc()
			d.iw.mu.Lock()
			log := now.Sub(d.iw.lastLog) > time.Minute
			if log {
				d.iw.lastLog = now
			}
			d.iw.mu.Unlock()
			if log {
				d.log.Warn("a member claiming the coordinator role gossips an index id the coordinator did not sign; ignored",
					zap.String("member", m.ID), zap.String("index_id", m.Meta.Index), zap.Error(err))
			}
			continue
		}
		d.noteIndex(m, now)
	}
}

// noteIndex records a verified index id; a new one after the first sight
// starts an offer.
func (d *Daemon) noteIndex(m cluster.Member, now time.Time) {
	w := &d.iw
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.remember(m.Meta.Index) {
		return
	}
	if !w.primed {
		w.primed = true // the first sight: nothing changed for this process
		return
	}
	if slices.Contains(w.served, m.Meta.Index) {
		return // that index asked for the inventory already
	}
	w.offer, w.offerUntil = m.Meta.Index, now.Add(indexOfferFor)
	w.changes.Inc()
	d.log.Info("a coordinator gossips a new index id: offering this rank's inventory in its heartbeats",
		zap.String("member", m.ID), zap.String("index_id", m.Meta.Index))
}

// remember records id as seen, reporting whether it was new; w.mu held.
func (w *indexWatch) remember(id string) bool {
	for _, s := range w.seen {
		if s == id {
			return false
		}
	}
	if len(w.seen) == maxSeenIndexes {
		w.seen = w.seen[1:]
	}
	w.seen = append(w.seen, id)
	return true
}

// indexOffer returns the id to offer in a heartbeat sent at now; "" none.
func (d *Daemon) indexOffer(now time.Time) string {
	d.iw.mu.Lock()
	defer d.iw.mu.Unlock()
	if d.iw.offer != "" && now.After(d.iw.offerUntil) {
		d.log.Warn("no coordinator asked for this rank's inventory after its index id changed; offer ended",
			zap.String("index_id", d.iw.offer), zap.Duration("offered_for", indexOfferFor))
		d.iw.offer = ""
	}
	return d.iw.offer
}

// inventoryTaken ends the offer: a coordinator asked for the inventory.
// index is the asking coordinator's index id (wire.HeaderIndex; "" from
// one that predates it): kept apart from the gossiped ids, so gossip
// showing it later starts no offer for an index that already has this
// rank's inventory. Unsigned, unlike a gossiped id (only the coordinator's
// identity may ask for the inventory): a forged one can only withhold an
// offer, the fallback of the coordinator's own resync requests, and
// cannot push a verified id out of seen (which would make it offer again).
func (d *Daemon) inventoryTaken(index string) {
	w := &d.iw
	w.mu.Lock()
	defer w.mu.Unlock()
	w.offer = ""
	if index == "" || len(index) > maxIndexIDBytes || slices.Contains(w.served, index) {
		return
	}
	if len(w.served) == maxServedIndexes {
		w.served = w.served[1:]
	}
	w.served = append(w.served, index)
}

// verifyIndex checks m's index signature against the coordinator's key
// (always nil when insecure).
func (d *Daemon) verifyIndex(m cluster.Member) error {
	if d.cfg.Insecure {
		return nil
	}
	if d.trust.coordKey == "" {
		return errors.New("no coordinator key to verify it with (the credentials have no users file)")
	}
	if m.Meta.IndexSig == "" {
		return errors.New("no signature")
	}
	sig, err := base64.StdEncoding.DecodeString(m.Meta.IndexSig)
	if err != nil {
		return err
	}
	return auth.Verify(d.trust.coordKey, cluster.IndexStatement(m.Meta.Incarnation, m.Meta.Index), sig)
}
