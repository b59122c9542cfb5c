package replica

import (
	"errors"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// TestNodeReplicatesWithoutPipelining: a started node's raft transport
// refuses to open a pipeline, so raft replicates one AppendEntries at a
// time to each follower (noPipelining). With raft 1.8's pipeline a
// follower's Success=false could deadlock the leader's sender: the
// follower got no more entries and Shutdown hung (stop 59's CI, 17
// minutes). Red with MaxRPCsInFlight left at raft's default: the
// transport opens the pipeline.
func TestNodeReplicatesWithoutPipelining(t *testing.T) {
	dir := t.TempDir()
	creds := loadTLS(t, caDir(t, "n1"), "n1")
	ix, err := index.Open(func() index.Config {
		c := index.DefaultConfig()
		c.Path, c.Logger, c.Registerer = filepath.Join(dir, "index.db"), zap.NewNop(), prometheus.NewRegistry()
		return c
	}())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ix.Close() }()
	rc := DefaultConfig()
	addr := "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t))
	rc.ID, rc.Bind, rc.Dir, rc.Peers, rc.Bootstrap = "n1", addr, filepath.Join(dir, "raft"), []Peer{{ID: "n1", Addr: addr}}, true
	n, err := New(rc, Options{Logger: zap.NewNop(), Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Start(ix, creds); err != nil {
		t.Fatal(err)
	}
	defer n.Shutdown()
	p, err := n.trans.AppendEntriesPipeline("n2", "127.0.0.1:1")
	if p != nil {
		_ = p.Close()
	}
	if !errors.Is(err, raft.ErrPipelineReplicationNotSupported) {
		t.Fatalf("the node's raft transport opened a pipeline (err %v): raft would pipeline its replication", err)
	}
}
