package coordinator

import (
	"sync"

	"github.com/kvtier/kvtier/wire"
)

// Fence epochs (C7, issue 11.2). A resync fetches a rank's inventory over
// NATS, which takes time; memberlist may declare the rank dead meanwhile.
// The inventory was taken before the death, so applying it would bring
// back the L1 placements the fence just dropped, and clear the fence.
//
// So every fence this coordinator commits for a rank advances the rank's
// fence epoch, and a resync records the epoch before it asks for the
// inventory. The inventory is applied only if the epoch is unchanged, or
// if it comes from a newer incarnation than the index knows (a restarted
// rankd answered: its inventory is the truth and supersedes the fenced
// one). The check and the apply, and each fence, run under the rank's
// gate, so a fence is either before the check (the inventory is dropped)
// or after the apply (it fences what the inventory brought).
//
// Epochs live in memory: no resync survives a coordinator restart.

// fenceGates holds one gate per rank this coordinator fenced or resynced.
type fenceGates struct {
	mu    sync.Mutex // guards gates
	gates map[wire.Rank]*fenceGate
}

// fenceGate orders the fences and inventory applies of one rank.
type fenceGate struct {
	mu    sync.Mutex // held across one fence or one epoch check + inventory apply
	epoch uint64     // fences committed; guarded by mu
}

func (g *fenceGates) gate(r wire.Rank) *fenceGate {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.gates == nil {
		g.gates = make(map[wire.Rank]*fenceGate)
	}
	fg := g.gates[r]
	if fg == nil {
		fg = &fenceGate{}
		g.gates[r] = fg
	}
	return fg
}

// epoch returns rank r's current fence epoch.
func (g *fenceGates) epoch(r wire.Rank) uint64 {
	fg := g.gate(r)
	fg.mu.Lock()
	defer fg.mu.Unlock()
	return fg.epoch
}

// forget drops rank r's gate (rank reset).
func (g *fenceGates) forget(r wire.Rank) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.gates, r)
}
