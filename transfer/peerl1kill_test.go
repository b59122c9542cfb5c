package transfer

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/transfer/hostl1"
	"github.com/kvtier/kvtier/wire"
)

// segHolderEnv makes the test binary a host L1 segment holder of rank
// test/0 in the directory it names (TestMain runs runSegHolder).
const segHolderEnv = "KVTIER_TEST_SEG_HOLDER"

// runSegHolder is the child of TestPeerL1HolderKilled: it creates rank
// test/0's segment as a rankd does, publishes chunk 0 of tp4MLA (the bytes
// the rig's newChunk makes), leaves a temporary segment file of its own
// (locked, as one being created), prints "ready" and waits to be killed
// (or for its stdin to close).
func runSegHolder(dir string) int {
	res, err := tp4MLA().Resolve()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	r0 := wire.Rank{Instance: "test", TPRank: 0}
	s, _, err := hostl1.Create(dir, r0, hostl1.NewGeometry(16, 64<<10), 1)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	size := res.ObjectSize(0)
	payload := testutil.RandomBytes(size, 0)
	copy(s.Data(), payload)
	key := dcp.Key{NS: res.Namespace, Chunk: chunkHash(0), Shard: uint16(res.ReadShard(0, 0))}
	if _, err := s.Publish(key, 0, size, checksum.Sum(payload)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	tmp, err := os.OpenFile(filepath.Join(dir, hostl1.FileName(r0)+".tmp-"+strconv.Itoa(os.Getpid())), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err == nil {
		err = syscall.Flock(int(tmp.Fd()), syscall.LOCK_EX)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// TestPeerL1HolderKilled (tiers4.4): rank 0's rankd is killed -9 (a real
// child process, SIGKILL) while its host L1 segment holds an object; the
// segment stays in the directory (as in /dev/shm), closed word unset.
// While the holder lived rank 1 restored the object from it; after the
// kill rank 1 never reads it (the holder's flock is gone: counted once as
// a dead holder, not opened again), the chunk fails and its pages are
// untouched. Rank 0's next start collects what the killed run left (the
// segment replaced, its temporary file removed) and serves peers again.
// Seen failing before the lock: after the kill rank 1 kept restoring from
// the dead rank's segment (OK, from L1); and without the collection the
// restart collected 1 file of 2 (the temporary file stayed).
func TestPeerL1HolderKilled(t *testing.T) {
	dir := hostL1Dir(t)
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), segHolderEnv+"="+dir)
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	kill := func() {
		if !killed {
			killed = true
			_ = child.Process.Signal(syscall.SIGKILL)
			_ = child.Wait()
			stdin.Close()
		}
	}
	t.Cleanup(kill)
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("segment holder: %q, %v", line, err)
	}

	dev := openDevice(t, "")
	r1 := newRig(t, dev, tp4MLA(), []int64{16})
	cfg := engineConfig(t, dev, 1, 4)
	cfg.HostL1Dir = dir
	e1 := newEngine(t, cfg)
	r1.register(e1)
	c := r1.newChunk(0, r1.consecutiveN(0)) // the holder's object
	retrieve := func(slot int) RetrieveResult {
		t.Helper()
		rr, err := e1.Retrieve(testCtx(t), r1.retrieveReq(1, []chunk{c}, [][][]int64{r1.consecutiveN(slot)}))
		if err != nil {
			t.Fatal(err)
		}
		return rr
	}
	if rr := retrieve(1); !rr.ChunkOK(0) || rr.Items[0].From != wire.L1 || e1.Stats().PeerL1Reads != 1 {
		t.Fatalf("with the holder alive: %+v, peer reads %d; want restored from its L1", rr.Items[0], e1.Stats().PeerL1Reads)
	}
	r1.expectRestored(c, r1.consecutiveN(1))
	r1.check("restored from the live holder")

	segPath := filepath.Join(dir, hostl1.FileName(wire.Rank{Instance: "test", TPRank: 0}))
	oldIno := hostl1.Inode(dir, wire.Rank{Instance: "test", TPRank: 0})
	kill()
	if _, err := os.Lstat(segPath); err != nil {
		t.Fatalf("the killed holder's segment: %v, want it left behind", err)
	}
	for i := range 2 {
		if rr := retrieve(2 + i); rr.ChunkOK(0) {
			t.Fatalf("read %d after the kill: %+v, want failed (the dead holder's segment is not read)", i, rr.Items[0])
		}
	}
	r1.check("after the kill: nothing written")
	if st := e1.Stats(); st.PeerL1Reads != 1 || st.PeerL1DeadHolder != 1 {
		t.Fatalf("after the kill: peer reads %d, dead holders %d; want 1 and 1 (counted once)", st.PeerL1Reads, st.PeerL1DeadHolder)
	}
	if v := testutil.Metric(t, gatherer(t, e1), "kvtier_transfer_peer_l1_dead_holder_total"); v != 1 {
		t.Fatalf("peer_l1_dead_holder_total = %v, want 1", v)
	}

	// Rank 0 starts again: it collects the segment and the temporary file.
	r0 := newRig(t, dev, tp4MLA(), []int64{16})
	cfg0 := engineConfig(t, dev, 0, 4)
	cfg0.HostL1Dir = dir
	e0 := newEngine(t, cfg0)
	r0.register(e0)
	if st := e0.Stats(); st.HostL1Collected != 2 {
		t.Fatalf("rank 0's restart collected %d files, want 2 (its old segment and temporary file)", st.HostL1Collected)
	}
	if tmps, _ := filepath.Glob(segPath + ".tmp-*"); len(tmps) != 0 {
		t.Fatalf("temporary segment files left: %v", tmps)
	}
	if ino := hostl1.Inode(dir, wire.Rank{Instance: "test", TPRank: 0}); ino == 0 || ino == oldIno {
		t.Fatalf("segment inode %d after the restart, the killed run's was %d", ino, oldIno)
	}
	if rr := retrieve(4); rr.ChunkOK(0) {
		t.Fatalf("read from the new segment before any store: %+v, want failed", rr.Items[0])
	}
	storeAll(t, e0, r0, "again", r0.newChunk(0, r0.consecutiveN(0)))
	if rr := retrieve(5); !rr.ChunkOK(0) || rr.Items[0].From != wire.L1 || e1.Stats().PeerL1Reads != 2 {
		t.Fatalf("after rank 0 stored again: %+v, peer reads %d; want restored from its new segment", rr.Items[0], e1.Stats().PeerL1Reads)
	}
	if got := r1.readChunk(r1.consecutiveN(5)); !bytes.Equal(got[0], c.packed[0]) {
		t.Fatal("restored other bytes from the new segment")
	}
}
