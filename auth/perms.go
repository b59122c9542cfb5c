package auth

import (
	"time"

	"github.com/kvtier/kvtier/wire"
	"github.com/nats-io/nats-server/v2/server"
)

// ResponseTTL is how long a responder may answer a request it received
// (NATS allow_responses). It exceeds every reply delay of the protocol: a
// restore.wait answered at a deadline of at most 60 s, a retrieve that
// waits on the device.
const ResponseTTL = 5 * time.Minute

// Perm is one identity's NATS permission set in plain data: subjects it
// may publish to, subjects it may subscribe to, and whether it may reply
// to the requests it receives.
type Perm struct {
	Publish   []string
	Subscribe []string
	Responses bool
}

// Permissions returns the permission set of id under subject prefix
// prefix (wire.Subjects). Every identity may subscribe to its own inbox
// (InboxPrefix) and nothing wider; no set contains a full wildcard.
//
//	coordinator  pub  <p>.rank.*.*.inventory, <p>.kvevents.*
//	             sub  <p>.events.>, <p>.heartbeat.>, <p>.coord.>, <p>.admin.>; replies
//	rankd i/t    pub  <p>.events.i.t, <p>.heartbeat.i.t, <p>.coord.restore.report.i.t, <p>.rank.i.t.freed
//	             sub  <p>.rank.i.t.inventory, <p>.rank.i.t.engine.*; replies
//	engine i     pub  <p>.rank.i.*.engine.*, <p>.coord.<op>.i for the engine ops
//	             sub  <p>.rank.i.*.freed
//	             (PP > 1: the same again for each stage instance i-pp<s>)
//	admin        pub  <p>.admin.<op> for the read-only ops
//	             sub  <p>.kvevents.* (routers: KV events, docs/kvevents.md)
//	admin-write  pub  <p>.admin.>
func Permissions(id Identity, prefix string) Perm {
	s := wire.Subjects{Prefix: prefix}
	p := s.Prefix
	if p == "" {
		p = wire.DefaultPrefix
	}
	inbox := id.InboxPrefix() + ".>"
	var out Perm
	switch id.Role {
	case RoleCoordinator:
		out = Perm{
			Publish:   []string{p + ".rank.*.*.inventory", s.KVEventsAll()},
			Subscribe: []string{s.EventsAll(), s.HeartbeatAll(), p + ".coord.>", p + ".admin.>"},
			Responses: true,
		}
	case RoleRankd:
		r := wire.Rank{Instance: id.Instance, TPRank: id.TPRank}
		out = Perm{
			Publish:   []string{s.Events(r), s.Heartbeat(r), s.Report(r), s.Freed(r)},
			Subscribe: []string{s.Inventory(r), s.Engine(r, "*")},
			Responses: true,
		}
	case RoleEngine:
		// Its own instance and, under PP > 1, each stage instance's.
		for _, inst := range id.Instances() {
			out.Publish = append(out.Publish, p+".rank."+inst+".*.engine.*")
			out.Subscribe = append(out.Subscribe, p+".rank."+inst+".*.freed")
			for _, op := range wire.EngineCoordOps {
				out.Publish = append(out.Publish, s.EngineCoord(inst, op))
			}
		}
	case RoleAdmin:
		for _, op := range wire.AdminReadOps {
			out.Publish = append(out.Publish, s.Admin(op))
		}
		// A router holds the admin identity: it reads every instance's
		// KV events (which prompts' chunks are cached where), as it may
		// already ask admin.route. No engine identity may: an engine
		// would learn what other tenants computed.
		out.Subscribe = []string{s.KVEventsAll()}
	case RoleAdminWrite:
		out.Publish = []string{s.Admin(">")}
	}
	out.Subscribe = append(out.Subscribe, inbox)
	return out
}

// serverPermissions turns a Perm into nats-server's form.
func (p Perm) serverPermissions() *server.Permissions {
	sp := &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: append([]string(nil), p.Publish...)},
		Subscribe: &server.SubjectPermission{Allow: append([]string(nil), p.Subscribe...)},
	}
	if p.Responses {
		sp.Response = &server.ResponsePermission{MaxMsgs: 1, Expires: ResponseTTL}
	}
	return sp
}
