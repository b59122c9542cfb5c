package bus

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats.go"
)

// invResponder serves an inventory in pages as a rank does. old: it
// decodes requests as a rankd from before binary pages (strictly, without
// the encoding field) and answers JSON. delay(i) holds page i back before
// answering; fail >= 1 answers that page with an error.
type invResponder struct {
	inv      wire.Inventory
	pageSize int
	old      bool
	fail     int
	delay    func(page int) time.Duration

	inFlight, maxInFlight atomic.Int32
	mu                    sync.Mutex // guards encodings and indexes
	encodings             map[string]int
	indexes               map[int][]string // each request's wire.HeaderIndex, by page
}

// oldRequest is wire.InventoryRequest before the encoding field.
type oldRequest struct {
	Snapshot string `json:"snapshot,omitempty"`
	Page     int    `json:"page"`
	PageSize int    `json:"page_size,omitempty"`
}

func (r *invResponder) serve(m *nats.Msg) {
	n := r.inFlight.Add(1)
	for {
		mx := r.maxInFlight.Load()
		if n <= mx || r.maxInFlight.CompareAndSwap(mx, n) {
			break
		}
	}
	// Out of flight before the answer leaves: the fetch sends its next
	// request as soon as it has this one's.
	code, msg, data := r.answer(m)
	r.inFlight.Add(-1)
	if code != "" {
		_ = RespondError(m, code, msg)
		return
	}
	_ = m.Respond(data)
}

// answer is serve's reply to m: an error code and message, or the bytes.
func (r *invResponder) answer(m *nats.Msg) (code, msg string, data []byte) {
	var req wire.InventoryRequest
	if r.old {
		var o oldRequest
		if err := Decode(m, &o); err != nil {
			return wire.CodeBadRequest, err.Error(), nil
		}
		req = wire.InventoryRequest{Snapshot: o.Snapshot, Page: o.Page, PageSize: o.PageSize}
	} else if err := Decode(m, &req); err != nil {
		return wire.CodeBadRequest, err.Error(), nil
	}
	r.mu.Lock()
	r.encodings[req.Encoding]++
	if r.indexes != nil {
		r.indexes[req.Page] = append(r.indexes[req.Page], m.Header.Get(wire.HeaderIndex))
	}
	r.mu.Unlock()
	if r.delay != nil {
		time.Sleep(r.delay(req.Page))
	}
	if r.fail > 0 && req.Page == r.fail {
		return wire.CodeInternal, "page lost", nil
	}
	pages := wire.PageInventory(&r.inv, "snap", r.pageSize)
	p := &pages[req.Page]
	var err error
	if req.Encoding == wire.InventoryEncodingBinary {
		data, err = p.MarshalBinary()
	} else {
		data, err = json.Marshal(wire.Reply[wire.InventoryPage]{OK: p})
	}
	if err != nil {
		panic(err)
	}
	return "", "", data
}

func inventoryServer(t *testing.T) *nats.Conn {
	srv := testutil.NATS(t)
	nc, err := Connect(srv.ClientURL(), "test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func randomInventory(n int) wire.Inventory {
	rng := rand.New(rand.NewPCG(3, uint64(n)))
	inv := wire.Inventory{Rank: wire.Rank{Instance: "e", TPRank: 2}, Incarnation: 5, Seq: 99, Objects: make([]wire.Placement, n)}
	for i := range inv.Objects {
		o := &inv.Objects[i]
		o.Key = dcp.Key{NS: dcp.Namespace{byte(rng.IntN(3))}, Shard: uint16(rng.IntN(8))}
		for j := range o.Key.Chunk {
			o.Key.Chunk[j] = byte(rng.Uint32())
		}
		o.Tier, o.Size, o.Sum = wire.Tier(1+rng.IntN(3)), rng.Uint64(), 1+rng.Uint64()
	}
	return inv
}

// The pipelined fetch returns the inventory exactly, in order, with the
// window's requests in flight at once even when later pages answer first;
// in binary from a current rank, in JSON from an older one (which refuses
// the encoding field) and when asked for JSON. The request of page 0 (each
// try of it) names the asking index (wire.HeaderIndex), the others none.
func TestFetchInventoryPipelined(t *testing.T) {
	nc := inventoryServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name       string
		old, json  bool
		objects    int
		window     int
		wantBinary bool
	}{
		{name: "binary", objects: 1000, window: 4, wantBinary: true},
		{name: "binary one page", objects: 7, window: 4, wantBinary: true},
		{name: "binary empty", objects: 0, window: 4, wantBinary: true},
		{name: "window 1", objects: 300, window: 1, wantBinary: true},
		{name: "older rank", old: true, objects: 1000, window: 4},
		{name: "asked for JSON", json: true, objects: 1000, window: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &invResponder{inv: randomInventory(tc.objects), pageSize: 64, old: tc.old, encodings: map[string]int{},
				indexes: map[int][]string{},
				// Earlier pages answer later: the window is full at once.
				delay: func(page int) time.Duration { return time.Duration(20-page%5*4) * time.Millisecond }}
			subject := "inv." + sanitizeName(tc.name)
			sub, err := nc.Subscribe(subject, func(m *nats.Msg) { go r.serve(m) })
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			const index = "0123456789abcdef0123456789abcdef"
			got, err := FetchInventoryWith(ctx, nc, subject, InventoryFetch{PerPage: 5 * time.Second, Window: tc.window, JSON: tc.json,
				Index: index})
			if err != nil {
				t.Fatal(err)
			}
			for page, ids := range r.indexes {
				for _, id := range ids {
					if want := map[bool]string{true: index}[page == 0]; id != want {
						t.Fatalf("page %d requested with index %q, want %q", page, id, want)
					}
				}
			}
			if len(r.indexes[0]) == 0 {
				t.Fatal("page 0 never requested")
			}
			want := r.inv
			if len(want.Objects) == 0 {
				want.Objects = []wire.Placement{}
			}
			if !reflect.DeepEqual(got, &want) {
				t.Fatalf("fetched inventory differs: %d objects, want %d", len(got.Objects), len(want.Objects))
			}
			pages := max(1, (tc.objects+63)/64)
			if tc.wantBinary && r.encodings[wire.InventoryEncodingBinary] != pages {
				t.Fatalf("binary requests %v, want %d", r.encodings, pages)
			}
			if !tc.wantBinary && r.encodings[""] != pages {
				t.Fatalf("JSON requests %v, want %d", r.encodings, pages)
			}
			if mx := int(r.maxInFlight.Load()); pages > tc.window && mx != tc.window {
				t.Fatalf("at most %d page requests in flight, want the window %d", mx, tc.window)
			}
		})
	}
}

// A failed page fails the fetch, the requests in flight are waited for,
// and a bound is enforced before more is fetched.
func TestFetchInventoryFailures(t *testing.T) {
	nc := inventoryServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r := &invResponder{inv: randomInventory(1000), pageSize: 64, fail: 5, encodings: map[string]int{}}
	sub, err := nc.Subscribe("inv.fail", func(m *nats.Msg) { go r.serve(m) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	_, err = FetchInventoryWith(ctx, nc, "inv.fail", InventoryFetch{PerPage: 5 * time.Second, Window: 4})
	var we *wire.Error
	if !errors.As(err, &we) || we.Code != wire.CodeInternal {
		t.Fatalf("fetch with page 5 failing: err = %v", err)
	}
	// A responder of its own: the first one's goroutines may still be
	// answering the cancelled requests.
	ok := &invResponder{inv: r.inv, pageSize: 64, encodings: map[string]int{}}
	sub2, err := nc.Subscribe("inv.ok", func(m *nats.Msg) { go ok.serve(m) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub2.Unsubscribe()
	if _, err := FetchInventoryWith(ctx, nc, "inv.ok", InventoryFetch{Window: 4, MaxObjects: 500}); !errors.Is(err, ErrInventoryTooLarge) {
		t.Fatalf("500-object bound: err = %v", err)
	}
	if _, err := FetchInventoryWith(ctx, nc, "inv.ok", InventoryFetch{Window: 4, MaxPages: 15}); !errors.Is(err, ErrInventoryTooLarge) {
		t.Fatalf("15-page bound: err = %v", err)
	}
	if _, err := FetchInventoryWith(ctx, nc, "inv.ok", InventoryFetch{}); !errors.Is(err, wire.ErrMalformed) {
		t.Fatalf("window 0: err = %v", err)
	}
}

func sanitizeName(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c == ' ' {
			b[i] = '_'
		}
	}
	return string(b)
}
