package coordinator

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/kvtier/kvtier/cluster"
	"github.com/nats-io/nats.go"
)

// Health is what /healthz reports: one word or line per dependency, and
// Status "ok" only when every one of them is well.
type Health struct {
	Status string `json:"status"` // "ok" or "unavailable"
	// Serving: "serving", or "starting", "shut down".
	Serving string `json:"serving"`
	// Index: "ok", or "failed: <the commit error>" once the index refuses
	// writes for good (every batch gets code internal until a restart).
	Index string `json:"index"`
	// NATS: "connected", or the connection's state.
	NATS string `json:"nats"`
	// Cluster: "alive" while this coordinator's memberlist member is alive
	// (it gossips, sees deaths and fences), or its state.
	Cluster string `json:"cluster"`
	// Raft, in replicated mode only: "leader", "follower of <id>", or
	// "no leader" / "candidate" / "shutdown" (unavailable: the cluster
	// cannot commit, as far as this node can tell).
	Raft string `json:"raft,omitempty"`
}

// Health checks the coordinator's dependencies (issue 11.6).
func (c *Coordinator) Health() Health {
	h := Health{Serving: "serving", Index: "ok", NATS: "connected", Cluster: "alive"}
	// Atomics, not lifeMu: Start holds that while the index opens, and
	// /healthz answers meanwhile.
	phase := c.phase.Load()
	ok := true
	switch {
	case c.shut.Load():
		h.Serving, ok = "shut down", false
	case phase < phaseServing:
		h.Serving, ok = "starting", false
	}
	switch {
	case phase < phaseIndex:
		h.Index, ok = "opening", false
	case c.idx == nil:
		h.Index, ok = "not open", false
	case c.idx.Failed() != nil:
		h.Index, ok = "failed: "+c.idx.Failed().Error(), false
	}
	switch {
	case c.nc == nil:
		h.NATS, ok = "not connected", false
	case !c.nc.IsConnected():
		h.NATS, ok = natsStatus(c.nc.Status()), false
	}
	switch {
	case phase < phaseServing || c.member == nil:
		h.Cluster, ok = "not joined", false
	default:
		if st := c.member.LocalMember().State; st != cluster.StateAlive {
			h.Cluster, ok = st.String(), false
		}
	}
	raftLine, well := c.repl.health()
	h.Raft, ok = raftLine, ok && well
	h.Status = "ok"
	if !ok {
		h.Status = "unavailable"
	}
	return h
}

func natsStatus(s nats.Status) string {
	switch s {
	case nats.DISCONNECTED:
		return "disconnected"
	case nats.RECONNECTING:
		return "reconnecting"
	case nats.CLOSED:
		return "closed"
	case nats.DRAINING_SUBS, nats.DRAINING_PUBS:
		return "draining"
	case nats.CONNECTING:
		return "connecting"
	}
	return fmt.Sprintf("status %d", s)
}

// healthz answers 200 with Health as JSON while every dependency is well,
// 503 with the same body otherwise.
func (c *Coordinator) healthz(w http.ResponseWriter, _ *http.Request) {
	h := c.Health()
	body, _ := json.Marshal(h)
	w.Header().Set("Content-Type", "application/json")
	if h.Status != "ok" {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_, _ = w.Write(append(body, '\n'))
}
