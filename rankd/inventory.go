package rankd

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/wire"
)

// snapshots keeps recent inventory snapshots, already cut into pages, so
// the coordinator can fetch a large inventory page by page from one
// consistent state (wire.InventoryRequest).
type snapshots struct {
	ttl time.Duration
	max int
	now func() time.Time

	mu    sync.Mutex // guards the following
	byID  map[string]*snapshot
	order []string // ids, oldest first
}

type snapshot struct {
	pageSize int
	expires  time.Time
	pages    []wire.InventoryPage
}

func newSnapshots(ttl time.Duration, maxSnaps int) *snapshots {
	return &snapshots{ttl: ttl, max: maxSnaps, now: time.Now, byID: make(map[string]*snapshot)}
}

// put stores inv under a new random id, cut into pages of pageSize,
// evicting expired snapshots and then the oldest beyond the limit, and
// returns the pages.
func (s *snapshots) put(inv *wire.Inventory, pageSize int) ([]wire.InventoryPage, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("inventory snapshot id: %w", err)
	}
	id := hex.EncodeToString(b[:])
	pages := wire.PageInventory(inv, id, pageSize)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	for len(s.order) >= s.max {
		delete(s.byID, s.order[0])
		s.order = s.order[1:]
	}
	s.byID[id] = &snapshot{pageSize: pageSize, expires: s.now().Add(s.ttl), pages: pages}
	s.order = append(s.order, id)
	return pages, nil
}

// get returns the pages of snapshot id and its page size; the error wraps
// ErrNotFound when it is unknown or expired.
func (s *snapshots) get(id string) ([]wire.InventoryPage, int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	snap, ok := s.byID[id]
	if !ok {
		return nil, 0, fmt.Errorf("inventory snapshot %q is unknown or expired (TTL %v, at most %d kept): %w",
			id, s.ttl, s.max, ErrNotFound)
	}
	return snap.pages, snap.pageSize, nil
}

func (s *snapshots) expireLocked() {
	now := s.now()
	keep := s.order[:0]
	for _, id := range s.order {
		if now.After(s.byID[id].expires) {
			delete(s.byID, id)
			continue
		}
		keep = append(keep, id)
	}
	s.order = keep
}

// inventoryPage answers one inventory request: a new snapshot when req
// names none, else a page of the named one.
func (d *Daemon) inventoryPage(req *wire.InventoryRequest) (*wire.InventoryPage, error) {
	switch {
	case req.Page < 0:
		return nil, badf("inventory page %d is negative", req.Page)
	case req.PageSize < 0 || req.PageSize > wire.MaxInventoryPageSize:
		return nil, badf("inventory page size %d outside 0..%d", req.PageSize, wire.MaxInventoryPageSize)
	case len(req.Snapshot) > MaxIDBytes:
		return nil, badf("inventory snapshot id is %d B, limit %d B", len(req.Snapshot), MaxIDBytes)
	}
	var pages []wire.InventoryPage
	if req.Snapshot == "" {
		size := req.PageSize
		if size == 0 {
			size = d.cfg.InventoryPageSize
		}
		inv := d.eng.Inventory()
		var err error
		if pages, err = d.snaps.put(&inv, size); err != nil {
			return nil, err
		}
		d.log.Info("inventory snapshot taken", zap.String("snapshot", pages[0].Snapshot), zap.Uint64("seq", inv.Seq),
			zap.Int("objects", len(inv.Objects)), zap.Int("pages", len(pages)))
	} else {
		var size int
		var err error
		if pages, size, err = d.snaps.get(req.Snapshot); err != nil {
			return nil, err
		}
		if req.PageSize != 0 && req.PageSize != size {
			return nil, badf("inventory snapshot %q has pages of %d objects, request asks for %d", req.Snapshot, size, req.PageSize)
		}
	}
	if req.Page >= len(pages) {
		return nil, badf("inventory page %d outside 0..%d of snapshot %q", req.Page, len(pages)-1, pages[0].Snapshot)
	}
	return &pages[req.Page], nil
}
