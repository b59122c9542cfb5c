package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/kvtier/kvtier/auth"
	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/enginesim"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/objstore"
	"github.com/kvtier/kvtier/wire"
)

// TestShareGroupL3 (issue 26.1, docs/sharing.md): engine0 and engine1
// are one share group with --share-l3, TP4/DCP4 each on the host backend,
// L3 on an S3 server in its own process, encrypted (--l3-encrypt).
// engine0 runs without L2: what it stores reaches only its L1 and, written
// behind, its prefix of the bucket. With engine0's rankds down and
// engine1's L2 empty, engine1's rankds, given --l3-shared-with engine0,
// restore the prompt COMPLETE and byte-exact from engine0's objects (each
// rank confirming engine0's recorded sums); started without the flag they
// refuse the plan's copies (counted) and nothing wrong is placed. engine2,
// outside the group, gets a miss. One of engine0's objects altered in the
// bucket (a GCM tag byte) fails its chunk at engine1's reader, counted,
// and is left as it was. Seen red without --share-l3 (nothing planned, so
// "no L3 copy of engine0 refused"), and with rankd not handing
// --l3-shared-with to the engine (every item missing: verdict failed).
func TestShareGroupL3(t *testing.T) {
	c := newKV(t, 4)
	c.addInstanceCreds("engine1")
	c.addInstanceCreds("engine2")
	endpoint, s3creds := c.startS3Node()
	l3 := []string{"--l3-endpoint", endpoint, "--l3-bucket", "kvtier", "--l3-prefix", "kv/",
		"--l3-credentials", s3creds, "--l3-insecure", "--l3-encrypt"}
	c.coordArgs = append(c.coordArgs, "--share-group", "chat=engine0,engine1", "--share-l3")
	c.rankArgs = append(append([]string{}, l3...), "--l2-dir=") // engine0: no L2
	c.startAll()
	const seed = "43"
	store := c.mustSim("--scenario", "tp4dcp4", "--phase", "store", "--seed", seed)
	c.eventually(60*time.Second, "engine0's L3 write-behind finished and reported", func() error {
		for r := range c.tp {
			n, err := c.tierCounts(r)
			if err != nil {
				return err
			}
			if n[wire.L2] != 0 || n[wire.L3] != store.Stored/c.tp {
				return fmt.Errorf("rank %d: %v placements, want %d in L3 and none in L2", r, n, store.Stored/c.tp)
			}
		}
		return c.agree()
	})
	c.stopRanks() // engine0's rankds are gone: only its L3 objects are left

	// engine2 is outside the group: a miss.
	sc, _ := enginesim.LookupScenario("tp4dcp4")
	plan, err := enginesim.NewPlan(sc, 43)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lr, err := bus.Call[wire.LookupReply](ctx, c.as(auth.Engine("engine2")), c.subj.EngineCoord("engine2", wire.CoordLookup),
		wire.LookupRequest{Namespace: plan.R.Namespace, Chunks: plan.Hashes})
	if err != nil || lr.Prefix != 0 {
		t.Fatalf("engine2's lookup of the group's prompt: %+v %v, want prefix 0", lr, err)
	}

	sum := func(ps []*proc, metric string) float64 {
		t.Helper()
		var v float64
		for r, p := range ps {
			v += testutil.MetricSum(t, metricsOf(t, "engine1 rankd "+strconv.Itoa(r), p.output()), metric)
		}
		return v
	}
	stop := func(ps []*proc) {
		for _, p := range ps {
			p.stop()
		}
	}
	restore := func(what string, expectFail bool) *enginesim.Result {
		t.Helper()
		args := []string{"--scenario", "tp4dcp4", "--phase", "restore", "--seed", seed, "--instance", "engine1"}
		if expectFail {
			args = append(args, "--expect-fail")
		}
		res, out, err := c.sim(args...)
		if res == nil || err != nil {
			t.Fatalf("%s: %+v %v\n%s", what, res, err, tail(out, 30))
		}
		exact(t, what, res)
		t.Logf("%s:\n%s", what, tableOf(out))
		return res
	}

	// engine1's rankds not told they may read engine0's objects: the
	// coordinator plans them, the rankds refuse them.
	c.rankArgs = append([]string{}, l3...)
	b := startInstance(c, "engine1")
	if res := restore("engine1 without --l3-shared-with", true); res.Verdict == wire.VerdictComplete && res.Prefix > 0 {
		t.Fatalf("engine1's rankds read engine0's L3 objects without --l3-shared-with: %+v", res)
	}
	if v := sum(b, "kvtier_transfer_l3_shared_refused_total"); v == 0 {
		t.Fatal("no L3 copy of engine0 refused")
	}
	stop(b)

	c.rankArgs = append(append([]string{}, l3...), "--l3-shared-with", "engine0")
	b = startInstance(c, "engine1")
	res := restore("engine1 restores engine0's prompt from engine0's L3", false)
	if res.Verdict != wire.VerdictComplete || res.Prefix != res.Chunks {
		t.Fatalf("engine1 restoring engine0's prompt from its L3: %+v", res)
	}
	if v := sum(b, "kvtier_transfer_l3_shared_restored_objects_total"); v != float64(store.Stored) {
		t.Fatalf("engine1's rankds read %v objects from engine0's L3, want the %d engine0 stored", v, store.Stored)
	}
	if got := testutil.Metric(t, c.coordMetrics(), "kvtier_coord_share_restores_total"); got < 1 {
		t.Fatalf("share restores %v, want >= 1", got)
	}
	stop(b)

	// One of engine0's rank 2 objects altered in the bucket: engine1's
	// rank 2 (the reader of shard 2) fails its chunk, and leaves it.
	oc := objstore.DefaultConfig()
	oc.Endpoint, oc.Bucket, oc.CredentialsFile, oc.Prefix, oc.Insecure = endpoint, "kvtier", s3creds, "kv/", true
	st, err := objstore.Open(ctx, oc)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var names []string
	if err := st.List(ctx, "engine0/", func(name string, _ int64) error {
		names = append(names, name)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var altered []byte
	var alteredName string
	for _, name := range names {
		body, _, err := st.Open(ctx, name, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		obj, err := io.ReadAll(body)
		body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if binary.BigEndian.Uint32(obj[109:113]) == 2 { // the writer's TP rank
			obj[len(obj)-1] ^= 0x01 // the GCM tag's last byte
			if err := st.Put(ctx, name, bytes.NewReader(obj), int64(len(obj))); err != nil {
				t.Fatal(err)
			}
			altered, alteredName = obj, name
			break
		}
	}
	if altered == nil {
		t.Fatal("engine0's rank 2 wrote no L3 object")
	}
	b = startInstance(c, "engine1")
	if res := restore("engine1 with one of engine0's objects altered", true); res.Verdict == wire.VerdictComplete && res.Prefix == res.Chunks {
		t.Fatalf("restore with an altered object: %+v, want a chunk failed", res)
	}
	if v := testutil.MetricSum(t, metricsOf(t, "engine1 rankd 2", b[2].output()), "kvtier_transfer_l3_checksum_failures_total"); v != 1 {
		t.Fatalf("engine1's rank 2 counted %v L3 objects failing verification, want 1", v)
	}
	body, _, err := st.Open(ctx, alteredName, 0, 0)
	if err != nil {
		t.Fatalf("the altered object is gone: %v", err)
	}
	now, _ := io.ReadAll(body)
	body.Close()
	if !bytes.Equal(now, altered) {
		t.Fatal("engine1's rankd changed engine0's object")
	}
}
