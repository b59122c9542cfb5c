package admin

import (
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/index"
	"github.com/kvtier/kvtier/wire"
)

// The admin replies, built from what the coordinator read (its member
// list, its index's reports): pure functions, no locks, no I/O. The
// coordinator's handlers gather the inputs and send the reply.

// memberRank is the rank a rankd member serves (as the coordinator's).
func memberRank(m cluster.Member) wire.Rank {
	return wire.Rank{Instance: m.Meta.Engine, TPRank: m.Meta.TPRank}
}

// Members is admin.members' reply: one entry per memberlist member.
func Members(members []cluster.Member) *wire.AdminMembersReply {
	rep := &wire.AdminMembersReply{Members: []wire.AdminMember{}}
	for _, mb := range members {
		am := wire.AdminMember{Name: mb.Name, ID: mb.ID, Role: string(mb.Meta.Role), State: mb.State.String(),
			Addr: mb.Addr, Incarnation: mb.Meta.Incarnation, NATS: mb.Meta.NATS, Since: mb.Since, Local: mb.Local}
		if mb.Meta.Role == cluster.RoleRankd {
			am.Rank = memberRank(mb).String()
		}
		rep.Members = append(rep.Members, am)
	}
	return rep
}

// Ranks is admin.ranks' reply: the index's ranks joined with the rankd
// members (by incarnation, else the newest member of the rank), then the
// members the index does not know, sorted by instance and TP rank.
// resyncing holds the ranks with a resync running.
func Ranks(ranks []index.RankInfo, members []cluster.Member, resyncing map[wire.Rank]bool) *wire.AdminRanksReply {
	type memberKey struct {
		r   wire.Rank
		inc uint64
	}
	byInc := make(map[memberKey]cluster.Member)
	latest := make(map[wire.Rank]cluster.Member)
	for _, mb := range members {
		if mb.Meta.Role != cluster.RoleRankd {
			continue
		}
		r := memberRank(mb)
		byInc[memberKey{r, mb.Meta.Incarnation}] = mb
		if old, ok := latest[r]; !ok || mb.Meta.Incarnation > old.Meta.Incarnation {
			latest[r] = mb
		}
	}
	rep := &wire.AdminRanksReply{Ranks: []wire.AdminRank{}}
	known := make(map[wire.Rank]bool)
	for _, ri := range ranks {
		known[ri.Rank] = true
		ar := wire.AdminRank{Rank: ri.Rank, Incarnation: ri.Incarnation, Liveness: "unknown",
			L1Objects: ri.L1Placements, L1Bytes: ri.L1Bytes, L2Objects: ri.L2Placements, L2Bytes: ri.L2Bytes,
			L3Objects: ri.L3Placements, L3Bytes: ri.L3Bytes, LastSeq: ri.LastSeq, Fenced: ri.Fenced, Resync: resyncing[ri.Rank]}
		if mb, ok := byInc[memberKey{ri.Rank, ri.Incarnation}]; ok {
			ar.Liveness, ar.Member = mb.State.String(), mb.ID
		} else if mb, ok := latest[ri.Rank]; ok {
			// A member of another incarnation (a restart not reported yet).
			ar.Liveness = fmt.Sprintf("%s (incarnation %d)", mb.State, mb.Meta.Incarnation)
			ar.Member = mb.ID
		}
		rep.Ranks = append(rep.Ranks, ar)
	}
	for r, mb := range latest {
		if !known[r] {
			rep.Ranks = append(rep.Ranks, wire.AdminRank{Rank: r, Incarnation: mb.Meta.Incarnation,
				Member: mb.ID, Liveness: mb.State.String()})
		}
	}
	slices.SortFunc(rep.Ranks, func(a, b wire.AdminRank) int {
		if a.Rank.Instance != b.Rank.Instance {
			if a.Rank.Instance < b.Rank.Instance {
				return -1
			}
			return 1
		}
		return a.Rank.TPRank - b.Rank.TPRank
	})
	return rep
}

// Object is one object of admin.object's reply: its placements (with
// their checksums: admin only, C9). chunk is its place in the asked
// chain, -1 for an object asked by key.
func Object(chunk int, k dcp.Key, holders []index.Holder) wire.ObjectInfo {
	oi := wire.ObjectInfo{Chunk: chunk, Key: k, Placements: []wire.ObjectPlacement{}}
	for _, h := range holders {
		oi.Placements = append(oi.Placements, wire.ObjectPlacement{Holder: h.Rank, Tier: h.Tier, Size: h.Size,
			Sum: h.Sum, Incarnation: h.Incarnation, Seq: h.Seq})
	}
	return oi
}

// Namespaces is admin.namespaces' reply.
func Namespaces(nss []index.NamespaceInfo) *wire.AdminNamespacesReply {
	rep := &wire.AdminNamespacesReply{Namespaces: []wire.AdminNamespace{}}
	for _, n := range nss {
		an := wire.AdminNamespace{Namespace: n.Namespace.String(), Chunks: n.Chunks, Objects: n.Objects,
			L1Placements: n.L1Placements, L1Bytes: n.L1Bytes, L2Placements: n.L2Placements, L2Bytes: n.L2Bytes}
		if s := n.Spec; s != nil {
			an.Registered = true
			an.Model, an.CacheSalt = s.Model, s.CacheSalt
			an.TP, an.DCP, an.Groups, an.ChunkTokens = s.Layout.TP, s.Layout.DCP, len(s.Groups), s.ChunkTokens
		}
		rep.Namespaces = append(rep.Namespaces, an)
	}
	return rep
}

// Verify is admin.verify's reply (and a replica's part of
// admin.raft.verify's).
func Verify(rep index.VerifyReport) *wire.AdminVerifyReply {
	return &wire.AdminVerifyReply{OK: rep.OK(), Checked: uint64(rep.Placements), Namespaces: rep.Namespaces, Ranks: rep.Ranks,
		Chunks: rep.Chunks, Placements: rep.Placements, LogRecords: rep.LogRecords, Mismatches: rep.Problems}
}
