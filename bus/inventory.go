package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// ErrInventoryTooLarge: an inventory declares more pages or objects than
// the caller's bound.
var ErrInventoryTooLarge = errors.New("inventory over the bound")

// DefaultInventoryWindow is the page requests FetchInventory keeps in
// flight: enough to hide the round trip behind the rank's encoding and
// the caller's decoding of 4096-object pages.
const DefaultInventoryWindow = 8

// InventoryFetch says how FetchInventoryWith fetches a rank's inventory.
type InventoryFetch struct {
	// PageSize is the objects per page; 0 uses the rank's default.
	PageSize int
	// PerPage > 0 bounds each page request on top of ctx.
	PerPage time.Duration
	// MaxPages and MaxObjects bound the snapshot (0: no bound): the fetch
	// fails with ErrInventoryTooLarge as soon as it declares more pages or
	// its pages hold more objects, so a lying rank cannot make the caller
	// fetch or hold more.
	MaxPages, MaxObjects int
	// Window is the page requests in flight at once (>= 1). Pages are
	// still taken in order, and the first failed one fails the fetch.
	Window int
	// JSON asks for JSON pages, as a coordinator older than the binary
	// pages does (tests of that path).
	JSON bool
	// Index is the asking coordinator's index id, sent with the request of
	// page 0 as wire.HeaderIndex; "" sends none.
	Index string
}

// FetchInventory requests a rank's inventory page by page on subject (see
// wire.InventoryRequest): page 0 of a new snapshot, then the remaining
// pages of that snapshot, DefaultInventoryWindow at a time, and assembles
// them. pageSize 0 uses the rank's default. perPage > 0 bounds each page
// request on top of ctx. Any error reply, timeout or page that does not
// belong to the snapshot fails the whole fetch.
func FetchInventory(ctx context.Context, nc *nats.Conn, subject string, pageSize int, perPage time.Duration) (*wire.Inventory, error) {
	return FetchInventoryBounded(ctx, nc, subject, pageSize, perPage, 0, 0)
}

// FetchInventoryBounded is FetchInventory with MaxPages and MaxObjects
// bounds (see InventoryFetch).
func FetchInventoryBounded(ctx context.Context, nc *nats.Conn, subject string, pageSize int, perPage time.Duration,
	maxPages, maxObjects int) (*wire.Inventory, error) {
	return FetchInventoryWith(ctx, nc, subject, InventoryFetch{PageSize: pageSize, PerPage: perPage,
		MaxPages: maxPages, MaxObjects: maxObjects, Window: DefaultInventoryWindow})
}

// FetchInventoryWith fetches a rank's inventory as f says and assembles
// it (StreamInventory, keeping every page).
func FetchInventoryWith(ctx context.Context, nc *nats.Conn, subject string, f InventoryFetch) (*wire.Inventory, error) {
	var inv *wire.Inventory
	err := StreamInventory(ctx, nc, subject, f, func(p *wire.InventoryPage) error {
		if inv == nil {
			// Room for what page 0 suggests, within the bound and never
			// more than 1 Mi objects up front (a lying rank's page count
			// costs it nothing).
			est := min(p.Pages*len(p.Objects), 1<<20)
			if f.MaxObjects > 0 {
				est = min(est, f.MaxObjects)
			}
			inv = &wire.Inventory{Rank: p.Rank, Incarnation: p.Incarnation, Seq: p.Seq,
				Objects: make([]wire.Placement, 0, max(est, len(p.Objects)))}
		}
		inv.Objects = append(inv.Objects, p.Objects...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return inv, nil
}

// StreamInventory fetches a rank's inventory as f says and hands each page
// to fn, in order, as it arrives; fn may keep nothing of a page it
// returns from, so the caller holds at most the pages in flight (f.Window)
// and the one fn is working on, never the whole inventory (issue 28.3).
// It asks for binary pages (wire.InventoryEncodingBinary); a rank too old
// to know them refuses the request's encoding field, and the fetch then
// reads JSON pages from it. Either reply form is accepted for any page.
// Every page after the first is checked to belong to the first's snapshot
// (wire.SamePage) before fn sees it. An error of fn ends the fetch with
// that error; so does a failed page, after the pages before it were
// handed over. The bounds of f are checked before fn sees the page that
// would break them: MaxPages on page 0's declared count, MaxObjects on
// the objects of the pages so far.
func StreamInventory(ctx context.Context, nc *nats.Conn, subject string, f InventoryFetch, fn func(*wire.InventoryPage) error) error {
	if f.Window < 1 {
		return fmt.Errorf("inventory fetch window %d: want >= 1: %w", f.Window, wire.ErrMalformed)
	}
	enc := wire.InventoryEncodingBinary
	if f.JSON {
		enc = ""
	}
	first, err := fetchPage(ctx, nc, subject, f.PerPage, f.Index, wire.InventoryRequest{PageSize: f.PageSize, Encoding: enc})
	if err != nil && enc != "" && olderRank(err) {
		enc = ""
		first, err = fetchPage(ctx, nc, subject, f.PerPage, f.Index, wire.InventoryRequest{PageSize: f.PageSize})
	}
	if err != nil {
		return err
	}
	if first.Pages < 1 || first.Snapshot == "" || first.Page != 0 {
		return fmt.Errorf("inventory page 0 from %s is page %d of %d of snapshot %q: %w",
			subject, first.Page, first.Pages, first.Snapshot, wire.ErrMalformed)
	}
	if f.MaxPages > 0 && first.Pages > f.MaxPages {
		return fmt.Errorf("inventory from %s declares %d pages, limit %d: %w", subject, first.Pages, f.MaxPages, ErrInventoryTooLarge)
	}
	objects := 0
	add := func(p *wire.InventoryPage) error {
		objects += len(p.Objects)
		if f.MaxObjects > 0 && objects > f.MaxObjects {
			return fmt.Errorf("inventory from %s holds more than %d objects (%d in its first %d pages), limit %d: %w",
				subject, f.MaxObjects, objects, p.Page+1, f.MaxObjects, ErrInventoryTooLarge)
		}
		return fn(p)
	}
	// The snapshot's header, kept for SamePage without its objects.
	head := *first
	head.Objects = nil
	if err := add(first); err != nil {
		return err
	}
	first = nil
	if head.Pages == 1 {
		return nil
	}

	// Pages 1.. with up to Window requests in flight, taken in order; the
	// requests still in flight when one fails are cancelled and waited for.
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	type result struct {
		p   *wire.InventoryPage
		err error
	}
	ring := make([]chan result, min(f.Window, head.Pages-1))
	next := 1
	launch := func() {
		i := next
		next++
		ch := make(chan result, 1)
		ring[i%len(ring)] = ch
		wg.Go(func() {
			p, err := fetchPage(cctx, nc, subject, f.PerPage, "", wire.InventoryRequest{Snapshot: head.Snapshot, Page: i,
				PageSize: f.PageSize, Encoding: enc})
			ch <- result{p, err}
		})
	}
	for next < head.Pages && next <= len(ring) {
		launch()
	}
	for i := 1; i < head.Pages; i++ {
		r := <-ring[i%len(ring)]
		if r.err != nil {
			return fmt.Errorf("inventory page %d of %d (snapshot %q): %w", i, head.Pages, head.Snapshot, r.err)
		}
		if next < head.Pages {
			launch()
		}
		if err := wire.SamePage(&head, r.p, i); err != nil {
			return fmt.Errorf("inventory from %s: %w", subject, err)
		}
		if err := add(r.p); err != nil {
			return err
		}
	}
	return nil
}

// olderRank reports whether err is a rank's refusal of the request's
// encoding field: a rankd from before binary inventory pages decodes
// requests strictly.
func olderRank(err error) bool {
	var we *wire.Error
	return errors.As(err, &we) && we.Code == wire.CodeBadRequest && strings.Contains(we.Message, `unknown field "encoding"`)
}

// fetchPage requests one page and decodes the reply: a binary page, or a
// JSON reply holding a page or an error. index, when set, goes as
// wire.HeaderIndex.
func fetchPage(ctx context.Context, nc *nats.Conn, subject string, perPage time.Duration, index string,
	req wire.InventoryRequest) (*wire.InventoryPage, error) {
	if perPage > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, perPage)
		defer cancel()
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode request for %s: %w", subject, err)
	}
	out := &nats.Msg{Subject: subject, Data: data}
	if index != "" {
		out.Header = nats.Header{wire.HeaderIndex: []string{index}}
	}
	msg, err := nc.RequestMsgWithContext(ctx, out)
	if err != nil {
		return nil, fmt.Errorf("request %s: %w", subject, err)
	}
	if wire.IsBinaryInventoryPage(msg.Data) {
		var p wire.InventoryPage
		if err := p.UnmarshalBinary(msg.Data); err != nil {
			return nil, fmt.Errorf("reply from %s: %w", subject, err)
		}
		return &p, nil
	}
	var rep wire.Reply[wire.InventoryPage]
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return nil, fmt.Errorf("decode reply from %s: %w", subject, errors.Join(err, wire.ErrMalformed))
	}
	switch {
	case rep.Error != nil:
		return nil, rep.Error
	case rep.OK == nil:
		return nil, fmt.Errorf("reply from %s has neither ok nor error: %w", subject, wire.ErrMalformed)
	case len(rep.OK.Objects) > wire.MaxInventoryPageSize:
		return nil, fmt.Errorf("inventory page from %s holds %d objects, limit %d: %w",
			subject, len(rep.OK.Objects), wire.MaxInventoryPageSize, wire.ErrMalformed)
	}
	return rep.OK, nil
}
