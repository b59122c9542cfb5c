package rankd

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/kvtier/kvtier/bus"
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

// inventoryServer answers the coordinator's paged inventory requests
// (resync; wire.InventoryRequest) from snapshots of inventory(). The
// daemon runs one; the resync benchmark runs the same code against a
// synthetic inventory.
type inventoryServer struct {
	snaps    *snapshots
	pageSize int // objects per page when the request names none
	// inventory is a consistent copy of what the rank holds, taken for a
	// new snapshot; index is the asking coordinator's index id
	// (wire.HeaderIndex), "" when the request carried none.
	inventory func(index string) wire.Inventory
	// probe answers a liveness probe (wire.InventoryRequest.Probe); nil
	// refuses probes.
	probe func() wire.RankProbe
	log   *zap.Logger
}

// serve decodes one request, answers it and returns the page it sent (nil
// when it answered an error) and the bytes of the reply.
func (s *inventoryServer) serve(msg *nats.Msg) (*wire.InventoryPage, int, error) {
	var req wire.InventoryRequest
	if len(msg.Data) > 0 && string(msg.Data) != "null" {
		if err := bus.Decode(msg, &req); err != nil {
			return nil, 0, bus.RespondError(msg, wire.CodeBadRequest, err.Error())
		}
	}
	if req.Probe {
		return nil, 0, s.answerProbe(msg, &req)
	}
	var page *wire.InventoryPage
	var err error
	if req.Encoding != "" && req.Encoding != wire.InventoryEncodingBinary {
		err = badf("inventory encoding %q unknown: want \"\" (JSON) or %q", req.Encoding, wire.InventoryEncodingBinary)
	} else {
		page, err = s.page(&req, msg.Header.Get(wire.HeaderIndex))
	}
	if err != nil {
		s.log.Warn("inventory request refused", zap.String("snapshot", req.Snapshot), zap.Int("page", req.Page), zap.Error(err))
		return nil, 0, bus.RespondError(msg, Code(err), err.Error())
	}
	var data []byte
	if req.Encoding == wire.InventoryEncodingBinary {
		data, err = page.MarshalBinary()
	} else {
		data, err = json.Marshal(wire.Reply[wire.InventoryPage]{OK: page})
	}
	if err != nil {
		return nil, 0, bus.RespondError(msg, wire.CodeInternal, "encode inventory page: "+err.Error())
	}
	return page, len(data), msg.Respond(data)
}

// answerProbe answers a liveness probe at once: no snapshot is taken.
func (s *inventoryServer) answerProbe(msg *nats.Msg, req *wire.InventoryRequest) error {
	if req.Snapshot != "" || req.Page != 0 || req.PageSize != 0 || req.Encoding != "" {
		return bus.RespondError(msg, wire.CodeBadRequest, "a liveness probe names no snapshot, page, page size or encoding")
	}
	if s.probe == nil {
		return bus.RespondError(msg, wire.CodeBadRequest, "this server answers no liveness probe")
	}
	p := s.probe()
	return bus.Respond(msg, &p)
}

// page answers one inventory request: a new snapshot when req names none
// (for the index whose id is index), else a page of the named one.
func (s *inventoryServer) page(req *wire.InventoryRequest, index string) (*wire.InventoryPage, error) {
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
			size = s.pageSize
		}
		inv := s.inventory(index)
		var err error
		if pages, err = s.snaps.put(&inv, size); err != nil {
			return nil, err
		}
		s.log.Info("inventory snapshot taken", zap.String("snapshot", pages[0].Snapshot), zap.Uint64("seq", inv.Seq),
			zap.Int("objects", len(inv.Objects)), zap.Int("pages", len(pages)))
	} else {
		var size int
		var err error
		if pages, size, err = s.snaps.get(req.Snapshot); err != nil {
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
