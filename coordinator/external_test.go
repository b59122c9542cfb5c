package coordinator

import (
	"testing"

	"github.com/kvtier/kvtier/bus"
	"github.com/kvtier/kvtier/wire"
)

// With an external NATS URL the coordinator starts no server of its own,
// serves on the external one, and gossips that URL for rankds to find.
func TestExternalNATS(t *testing.T) {
	ecfg := bus.DefaultEmbeddedConfig()
	ecfg.Port = 0
	ecfg.Insecure = true
	ext, err := bus.StartEmbedded(ecfg) // stands in for an operator's NATS cluster
	if err != nil {
		t.Fatal(err)
	}
	defer ext.Shutdown()

	c := startCoord(t, func(cfg *Config) { cfg.NATSURL = ext.ClientURL() })
	if c.nsrv != nil {
		t.Fatal("coordinator started an embedded NATS server although an external URL was configured")
	}
	if c.NATSURL() != ext.ClientURL() {
		t.Fatalf("coordinator uses %s, want the external %s", c.NATSURL(), ext.ClientURL())
	}
	nc, err := bus.Connect(ext.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ns := register(t, nc, c.subj, testSpec(2))
	b := storeBatch(wire.Rank{Instance: "eng", TPRank: 0}, 1, 0, ns, chain(ns, 4, 1), wire.L1)
	if ack, werr := sendBatch(t, nc, c.subj, b); werr != nil || ack.AppliedThrough != 4 {
		t.Fatalf("ack over the external server = %+v, %v", ack, werr)
	}
	m := c.member.LocalMember().Meta
	if len(m.NATS) != 1 || m.NATS[0] != ext.ClientURL() {
		t.Fatalf("gossiped NATS URLs %v, want [%s]", m.NATS, ext.ClientURL())
	}
	mustVerify(t, c)
}
