package hostl1

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

func testSeg(t *testing.T, slabs uint64) *Segment {
	t.Helper()
	geo := NewGeometry(slabs, 4096)
	mem := make([]uint64, geo.Size()/8) // 8-aligned, like a mapping
	all := unsafe.Slice((*byte)(unsafe.Pointer(&mem[0])), geo.Size())
	s := &Segment{meta: all[:geo.dataOff], data: all[geo.dataOff:], geo: geo}
	s.initHeader(7, 1)
	return s
}

func segKey(i int) dcp.Key {
	var k dcp.Key
	k.NS[0] = 0xaa
	k.Chunk[0], k.Chunk[1] = byte(i), byte(i>>8)
	k.Shard, k.Group = uint16(i%3), uint16(i%2)
	return k
}

// TestSegPublishFindRetire: a published object is found with exactly its
// fields; another key is not; a retired one is gone; republishing gives a
// new generation; colliding keys all stay findable across tombstones.
func TestSegPublishFindRetire(t *testing.T) {
	s := testSeg(t, 16)
	var slots []uint64
	for i := range 20 {
		sl, err := s.Publish(segKey(i), uint64(i%16)*4096, 100+uint64(i), 0xfeed0000+uint64(i))
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, sl)
	}
	for i := range 20 {
		v, miss := s.Find(segKey(i))
		if miss != Hit || v.Off != uint64(i%16)*4096 || v.Size != 100+uint64(i) || v.Sum != 0xfeed0000+uint64(i) || v.slot != slots[i] || v.gen%2 != 0 {
			t.Fatalf("key %d: %+v miss %d", i, v, miss)
		}
	}
	if _, miss := s.Find(segKey(99)); miss != Absent {
		t.Fatalf("unknown key: miss %d, want Absent", miss)
	}
	for i := 0; i < 20; i += 2 {
		s.Retire(slots[i])
	}
	for i := range 20 {
		_, miss := s.Find(segKey(i))
		if want := map[bool]Miss{true: Absent, false: Hit}[i%2 == 0]; miss != want {
			t.Fatalf("after retiring the even keys, key %d: miss %d want %d", i, miss, want)
		}
	}
	old, _ := s.Find(segKey(1))
	s.Retire(old.slot)
	sl, err := s.Publish(segKey(1), 8192, 5, 6)
	if err != nil {
		t.Fatal(err)
	}
	v, miss := s.Find(segKey(1))
	if miss != Hit || v.Off != 8192 || v.Size != 5 || v.Sum != 6 || v.slot != sl || (v.slot == old.slot && v.gen == old.gen) {
		t.Fatalf("republished: %+v (old %+v)", v, old)
	}
}

// TestSegOutOfRangeSlotIsMiss: a live slot naming bytes outside the data
// region (a damaged catalog) is a miss, never a read out of range.
func TestSegOutOfRangeSlotIsMiss(t *testing.T) {
	s := testSeg(t, 4)
	if _, err := s.Publish(segKey(1), uint64(len(s.data))-10, 11, 1); err != nil {
		t.Fatal(err)
	}
	if v, miss := s.Find(segKey(1)); miss != Absent {
		t.Fatalf("slot past the data region (%d B): %+v miss %d, want Absent", len(s.data), v, miss)
	}
}

// TestSegTornSlot: a slot the holder is rewriting (odd seq) is never
// taken; once the rewrite ends it is.
func TestSegTornSlot(t *testing.T) {
	s := testSeg(t, 4)
	sl, _ := s.Publish(segKey(3), 4096, 10, 11)
	seq := s.seq(sl)
	g := seq.Load()
	seq.Store(g + 1) // the holder died (or is) mid-rewrite
	s.u64(s.slot(sl) + 72).Store(999)
	if v, miss := s.Find(segKey(3)); miss != Busy {
		t.Fatalf("mid-rewrite slot: %+v miss %d, want Busy", v, miss)
	}
	seq.Store(g + 2)
	if v, miss := s.Find(segKey(3)); miss != Hit || v.Size != 999 || v.gen != g+2 {
		t.Fatalf("after the rewrite: %+v miss %d", v, miss)
	}
}

// TestSegStaleGeneration: a lease on a slot found before the holder
// retired or replaced it is refused and given back at once; a lease on
// the current generation holds the slot until given back or too old.
func TestSegStaleGeneration(t *testing.T) {
	s := testSeg(t, 4)
	sl, _ := s.Publish(segKey(5), 0, 10, 11)
	v, _ := s.Find(segKey(5))
	s.Retire(sl)
	if _, err := s.Publish(segKey(5), 4096, 10, 12); err != nil { // same slot, new generation
		t.Fatal(err)
	}
	if s.Lease(v, 100) {
		t.Fatalf("lease on generation %d taken; the slot is at %d", v.gen, s.seq(v.slot).Load())
	}
	if n := s.leases(v.slot).Load(); n != 0 || s.Leased(v.slot, 100, 50) {
		t.Fatalf("refused lease left %d leases", n)
	}
	cur, _ := s.Find(segKey(5))
	if cur.Off != 4096 || cur.Sum != 12 || !s.Lease(cur, 100) {
		t.Fatalf("current generation: %+v", cur)
	}
	if !s.Leased(cur.slot, 120, 50) {
		t.Fatal("a 20 ns old lease with a 50 ns TTL is not seen")
	}
	if s.Leased(cur.slot, 151, 50) {
		t.Fatal("a lease older than its TTL still holds the slot")
	}
	s.Unlease(cur)
	if s.Leased(cur.slot, 120, 50) {
		t.Fatal("a given-back lease still holds the slot")
	}
}

// TestSegConcurrentRewritesNeverTorn: while the holder keeps rewriting
// a slot with consistent (off, size, sum) triples, every hit a reader
// gets is one of them, never a mix.
func TestSegConcurrentRewritesNeverTorn(t *testing.T) {
	s := testSeg(t, 4)
	sl, _ := s.Publish(segKey(9), 4096, 1, 1^0x5555)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		w := keyWords(segKey(9))
		for x := uint64(1); !stop.Load(); x++ {
			s.write(sl, slotLive, w, x*4096%uint64(len(s.data)-4096), x, x^0x5555)
			if x%16 == 0 {
				runtime.Gosched() // on a loaded machine the reader must get a window between rewrites
			}
		}
	}()
	// At least 50,000 reads, and on until 100 hits or 20 s: a busy
	// machine can hand the writer most of the time.
	hits, tries := 0, 0
	for deadline := time.Now().Add(20 * time.Second); tries < 50000 || hits < 100 && time.Now().Before(deadline); tries++ {
		v, miss := s.Find(segKey(9))
		if miss != Hit {
			continue
		}
		hits++
		if v.Sum != v.Size^0x5555 || v.Off != v.Size*4096%uint64(len(s.data)-4096) {
			stop.Store(true)
			wg.Wait()
			t.Fatalf("torn slot read: %+v", v)
		}
	}
	stop.Store(true)
	wg.Wait()
	if hits == 0 {
		t.Fatalf("no consistent read in %d tries", tries)
	}
}

// TestSegHeaderChecks: a peer refuses a segment whose header is not one.
func TestSegHeaderChecks(t *testing.T) {
	s := testSeg(t, 8)
	size := s.geo.Size()
	hdr := append([]byte(nil), s.meta[:segHeaderBytes]...)
	if g, inc, err := parseSegHeader(hdr, size); err != nil || g != s.geo || inc != 7 {
		t.Fatalf("good header: %+v %d %v", g, inc, err)
	}
	if _, _, err := parseSegHeader(hdr, size-4096); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("short file: %v", err)
	}
	bad := append([]byte(nil), hdr...)
	bad[0] ^= 1
	if _, _, err := parseSegHeader(bad, size); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("bad magic: %v", err)
	}
	bad = append([]byte(nil), hdr...)
	bad[16]++ // slot count
	if _, _, err := parseSegHeader(bad, size); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("bad slot count: %v", err)
	}
}

// TestSegFileSafety: the directory must be private and real; a peer's
// segment must be a private regular file, never followed through a
// symlink.
func TestSegFileSafety(t *testing.T) {
	dir := t.TempDir()
	r0 := wire.Rank{Instance: "inst", TPRank: 0}
	r1 := wire.Rank{Instance: "inst", TPRank: 1}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Create(dir, r0, NewGeometry(4, 4096), 1); !errors.Is(err, ErrConfig) {
		t.Fatalf("0755 dir: %v", err)
	}
	_ = os.Chmod(dir, 0o700)
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Create(link, r0, NewGeometry(4, 4096), 1); !errors.Is(err, ErrConfig) {
		t.Fatalf("symlinked dir: %v", err)
	}
	s, _, err := Create(dir, r0, NewGeometry(4, 4096), 1)
	if err != nil {
		t.Fatal(err)
	}
	p, err := OpenPeer(dir, r0)
	if err != nil || p.incarnation != 1 || p.seg.geo != s.geo {
		t.Fatalf("open a good segment: %v", err)
	}
	p.Unmap()
	if err := os.Symlink(filepath.Join(dir, FileName(r0)), filepath.Join(dir, FileName(r1))); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenPeer(dir, r1); err == nil {
		t.Fatal("a symlinked segment was opened")
	}
	_ = os.Remove(filepath.Join(dir, FileName(r1)))
	if err := os.WriteFile(filepath.Join(dir, FileName(r1)), make([]byte, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenPeer(dir, r1); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("0644 segment file: %v", err)
	}
	s.Close()
	if _, err := os.Lstat(filepath.Join(dir, FileName(r0))); !os.IsNotExist(err) {
		t.Fatalf("closed segment left its file: %v", err)
	}
}

// TestSegDeadReadersLeaseEndsWithItsObject (issue 29.5): a reader that
// died holding a lease kept its slot leased for every later object in it
// (the count was never reset, and each later reader refreshed the lease
// time). The lease now ends with the object: after a rewrite, a reader that
// takes and gives back a lease leaves the slot unleased, and a late
// give-back of the old object's lease never takes the count below zero
// (one that comes after a new lease can still cancel it: the documented
// residual race, caught by the reader's checksum).
func TestSegDeadReadersLeaseEndsWithItsObject(t *testing.T) {
	s := testSeg(t, 4)
	sl, _ := s.Publish(segKey(1), 0, 10, 11)
	dead, _ := s.Find(segKey(1))
	if !s.Lease(dead, 100) { // this reader dies holding it
		t.Fatal("lease refused")
	}
	s.Retire(sl)                                                  // its lease expired: the holder evicts the object
	if _, err := s.Publish(segKey(1), 4096, 10, 12); err != nil { // the same slot, a new object
		t.Fatal(err)
	}
	cur, miss := s.Find(segKey(1))
	if miss != Hit || cur.slot != sl {
		t.Fatalf("the new object is not in the old slot: %+v %d", cur, miss)
	}
	if !s.Lease(cur, 1000) {
		t.Fatal("lease on the new object refused")
	}
	s.Unlease(cur)
	if s.Leased(sl, 1010, 50) {
		t.Fatalf("the slot stays leased by the dead reader (%d leases)", s.leases(sl).Load())
	}
	s.Unlease(dead) // a late give-back of the old object's lease: not below zero
	if n := s.leases(sl).Load(); n != 0 {
		t.Fatalf("a late give-back took the count to %d", n)
	}
	live, _ := s.Find(segKey(1))
	if !s.Lease(live, 2000) || !s.Leased(sl, 2010, 50) {
		t.Fatal("a lease after the late give-back is not seen")
	}
	s.Unlease(live)
	s.Unlease(live)
	if n := s.leases(sl).Load(); n != 0 {
		t.Fatalf("leases went to %d", n)
	}
}
