package rankd

import (
	"encoding/base64"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// indexWatchRig is a daemon with the index watch and the credentials of
// an instance "eng": seed is the coordinator's key, other another
// identity's; sign signs an index statement, coord gossips a coordinator.
type indexWatchRig struct {
	d           *Daemon
	seed, other *auth.Seed
	sign        func(s *auth.Seed, inc uint64, id string) string
	coord       func(inc uint64, id, sig string) []cluster.Member
}

func newIndexWatchRig(t *testing.T) indexWatchRig {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	if err := auth.Init(dir, []auth.Instance{{Name: "eng", TPSize: 1}}); err != nil {
		t.Fatal(err)
	}
	seed, err := auth.LoadSeed(filepath.Join(dir, "coordinator.nk"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := auth.LoadSeed(filepath.Join(dir, "admin.nk"))
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{cfg: DefaultConfig(wire.Rank{Instance: "eng"}), log: zaptest.NewLogger(t), met: newMetrics("eng/0")}
	d.cfg.Rank, d.cfg.CredsDir = wire.Rank{Instance: "eng"}, dir
	if err := d.initIndexWatch(); err != nil {
		t.Fatal(err)
	}
	if err := d.loadAuth(); err != nil {
		t.Fatal(err)
	}
	sign := func(s *auth.Seed, inc uint64, id string) string {
		sig, err := s.Sign(cluster.IndexStatement(inc, id))
		if err != nil {
			t.Fatal(err)
		}
		return base64.StdEncoding.EncodeToString(sig)
	}
	coord := func(inc uint64, id, sig string) []cluster.Member {
		return []cluster.Member{{Name: "coordinator", ID: "coordinator@x", State: cluster.StateAlive,
			Meta: cluster.Meta{Role: cluster.RoleCoordinator, Incarnation: inc, Index: id, IndexSig: sig}}}
	}
	return indexWatchRig{d: d, seed: seed, other: other, sign: sign, coord: coord}
}

// TestIndexWatch (issue 29.2): the first index id a rank sees is only
// recorded; a new one signed by the coordinator's key makes the rank offer
// its inventory (wire.Heartbeat.OfferIndex) until it serves one; a forged
// id (unsigned, signed by another identity, or a signature of another id
// or incarnation) is ignored and counted, and so is every id when the
// rank has no key to verify with; a replayed id already seen offers
// nothing. Red with the signature check removed (the forged ids were
// offered) and with the first sight treated as a change.
func TestIndexWatch(t *testing.T) {
	rig := newIndexWatchRig(t)
	d, seed, other, sign, coord := rig.d, rig.seed, rig.other, rig.sign, rig.coord
	const idA, idB, idC = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "cccccccccccccccccccccccccccccccc"
	now := time.Now()
	offer := func() string { return d.indexOffer(now) }
	untrusted := func() float64 { return testutil.Metric(t, d.met.reg, "kvtier_rankd_untrusted_index_ids_total") }
	changes := func() float64 { return testutil.Metric(t, d.met.reg, "kvtier_rankd_index_changes_total") }

	d.watchIndex(coord(7, idA, sign(seed, 7, idA)), now)
	if offer() != "" || changes() != 0 {
		t.Fatalf("the first id seen made an offer %q (changes %v)", offer(), changes())
	}
	for i, forged := range [][]cluster.Member{
		coord(8, idB, ""),                     // unsigned
		coord(8, idB, "!!"),                   // not base64
		coord(8, idB, sign(other, 8, idB)),    // another identity's key
		coord(8, idB, sign(seed, 8, idC)),     // the coordinator's signature of another id
		coord(9, idB, sign(seed, 8, idB)),     // of another incarnation
		coord(8, idB, sign(seed, 8, idB)[4:]), // truncated
	} {
		d.watchIndex(forged, now)
		if offer() != "" || changes() != 0 || untrusted() != float64(i+1) {
			t.Fatalf("forged id %d: offer %q, changes %v, untrusted %v", i, offer(), changes(), untrusted())
		}
	}
	d.watchIndex(coord(8, idB, sign(seed, 8, idB)), now)
	if offer() != idB || changes() != 1 {
		t.Fatalf("signed new id: offer %q, changes %v", offer(), changes())
	}
	d.watchIndex(coord(8, idB, sign(seed, 8, idB)), now) // the same id again: one change
	if changes() != 1 {
		t.Fatalf("the same id counted again: changes %v", changes())
	}
	d.inventoryTaken("")
	if offer() != "" {
		t.Fatalf("offer %q after the inventory was served", offer())
	}
	d.watchIndex(coord(7, idA, sign(seed, 7, idA)), now) // a replay of the old signed id
	if offer() != "" || changes() != 1 {
		t.Fatalf("a replayed id already seen: offer %q, changes %v", offer(), changes())
	}
	d.watchIndex(coord(10, idC, sign(seed, 10, idC)), now)
	if offer() != idC {
		t.Fatalf("offer %q, want %q", offer(), idC)
	}
	if got := d.indexOffer(now.Add(indexOfferFor + time.Second)); got != "" {
		t.Fatalf("offer %q past indexOfferFor", got)
	}
	// Without a key to verify with, no id is acted on.
	d.trust.coordKey = ""
	d.watchIndex(coord(11, "dddddddddddddddddddddddddddddddd", sign(seed, 11, "dddddddddddddddddddddddddddddddd")), now)
	if offer() != "" || untrusted() != 7 {
		t.Fatalf("no key: offer %q, untrusted %v", offer(), untrusted())
	}
}

// TestIndexWatchInventoryNamesTheIndex: an inventory request that names
// its index (wire.HeaderIndex) means gossip showing that id afterwards
// starts no offer (the second resync after a coordinator restarted on a
// lost directory); a later new id that never asked is still offered; a
// request naming none, or an overlong id, changes nothing but ending the
// offer; a flood of named ids cannot push a verified id out of the seen
// ones (which would offer it again). Red with the served id not checked
// (an offer of idB) and with served ids kept in seen (idA offered again
// after the flood).
func TestIndexWatchInventoryNamesTheIndex(t *testing.T) {
	rig := newIndexWatchRig(t)
	d, seed := rig.d, rig.seed
	const idA, idB, idC = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "cccccccccccccccccccccccccccccccc"
	now := time.Now()
	offer := func() string { return d.indexOffer(now) }
	changes := func() float64 { return testutil.Metric(t, d.met.reg, "kvtier_rankd_index_changes_total") }

	// The first coordinator seen; then a new one (restarted on a lost
	// directory), whose start-up resync comes before its gossip.
	const id0 = "00000000000000000000000000000000"
	d.watchIndex(rig.coord(6, id0, rig.sign(seed, 6, id0)), now)
	d.inventoryTaken(idA)
	d.watchIndex(rig.coord(7, idA, rig.sign(seed, 7, idA)), now)
	if offer() != "" || changes() != 0 {
		t.Fatalf("an id whose index took the inventory made an offer %q (changes %v)", offer(), changes())
	}
	// Restarted on a lost directory again: asked first, then gossiped.
	d.inventoryTaken(idB)
	d.watchIndex(rig.coord(8, idB, rig.sign(seed, 8, idB)), now)
	if offer() != "" || changes() != 0 {
		t.Fatalf("offer %q (changes %v) for an index that has the inventory", offer(), changes())
	}
	// A flood of named ids (a forged header) leaves the seen ids alone.
	for i := range 3 * maxSeenIndexes {
		d.inventoryTaken(fmt.Sprintf("%032x", i+1))
	}
	d.watchIndex(rig.coord(7, idA, rig.sign(seed, 7, idA)), now)
	if offer() != "" || changes() != 0 {
		t.Fatalf("a verified id seen before was offered again after a flood of named ids: offer %q, changes %v", offer(), changes())
	}
	// One that never asked (the rank was unreachable at its start): offered.
	d.inventoryTaken("")
	d.inventoryTaken(strings.Repeat("d", maxIndexIDBytes+1))
	d.watchIndex(rig.coord(9, idC, rig.sign(seed, 9, idC)), now)
	if offer() != idC || changes() != 1 {
		t.Fatalf("a new index that never asked: offer %q, changes %v", offer(), changes())
	}
	d.inventoryTaken(idC)
	if offer() != "" {
		t.Fatalf("offer %q after its index took the inventory", offer())
	}
}
