package wire

import (
	"time"

	"github.com/kvtier/kvtier/dcp"
)

// Coordinator lookup (<p>.coord.lookup) and admin (<p>.admin.<op>) messages.
// Every request and reply is JSON inside a Reply envelope.

// Admin operations, the last token of <p>.admin.<op>.
const (
	AdminMembers    = "members"
	AdminRanks      = "ranks"
	AdminObject     = "object"
	AdminNamespaces = "namespaces"
	AdminRestores   = "restores"
	AdminVerify     = "verify"
	// AdminRankReset mutates the index (an admin-write operation):
	// AdminRankResetRequest -> AdminRankResetReply.
	AdminRankReset = "rank.reset"
	// AdminRaft is answered by every coordinator of a replicated cluster
	// with its own raft state (AdminRaftNode), not by the leader alone:
	// read it by collecting replies (one request, several replies).
	AdminRaft = "raft"
	// AdminRaftAddVoter and AdminRaftRemove change the raft membership
	// (admin-write, leader only): AdminRaftChangeRequest ->
	// AdminRaftChangeReply.
	AdminRaftAddVoter = "raft.add_voter"
	AdminRaftRemove   = "raft.remove_server"
	// AdminRaftVerify, like AdminRaft, is answered by every coordinator:
	// its own index verified, and a digest of its state at the raft index
	// it has applied (AdminRaftVerifyReply), so replicas can be compared.
	AdminRaftVerify = "raft.verify"
)

// AdminRaftVerifyReply is one replica's verify and state digest.
type AdminRaftVerifyReply struct {
	ID string `json:"id"`
	// RaftIndex is the raft index the digest's state is at; Digest is the
	// hex SHA-256 of the index's canonical dump there. Two replicas at the
	// same raft index must have the same digest.
	RaftIndex uint64           `json:"raft_index"`
	Digest    string           `json:"digest"`
	Verify    AdminVerifyReply `json:"verify"`
}

// AdminRaftNode is one coordinator's raft state.
type AdminRaftNode struct {
	ID       string `json:"id"`
	Addr     string `json:"addr"`
	State    string `json:"state"` // Leader | Follower | Candidate | Shutdown
	Term     uint64 `json:"term"`
	LeaderID string `json:"leader_id"`
	// LastLogIndex is the last entry in the node's log; CommitIndex the
	// last it knows committed; AppliedIndex the last handed to its state
	// machine; IndexApplied the last its index committed to bbolt.
	LastLogIndex  uint64            `json:"last_log_index"`
	CommitIndex   uint64            `json:"commit_index"`
	AppliedIndex  uint64            `json:"applied_index"`
	IndexApplied  uint64            `json:"index_applied"`
	SnapshotIndex uint64            `json:"snapshot_index"`
	Servers       []AdminRaftServer `json:"servers"`
}

// AdminRaftServer is one server of the raft configuration.
type AdminRaftServer struct {
	ID       string `json:"id"`
	Addr     string `json:"addr"`
	Suffrage string `json:"suffrage"` // Voter | Nonvoter | Staging
}

// AdminRaftChangeRequest names the server to add (ID and Addr) or remove
// (ID).
type AdminRaftChangeRequest struct {
	ID   string `json:"id"`
	Addr string `json:"addr,omitempty"`
}

// AdminRaftChangeReply is the configuration after the change.
type AdminRaftChangeReply struct {
	Index   uint64            `json:"index"`
	Servers []AdminRaftServer `json:"servers"`
}

// AdminRankResetRequest asks the coordinator to forget a rank's
// incarnations and placements (undoing an implausible incarnation); the
// rank's real incarnation then resyncs.
type AdminRankResetRequest struct {
	Rank string `json:"rank"` // instance/tp
}

// AdminRankResetReply says what the reset dropped.
type AdminRankResetReply struct {
	Rank                string `json:"rank"`
	PreviousIncarnation uint64 `json:"previous_incarnation"`
	Placements          int    `json:"placements"` // dropped
	Restores            int    `json:"restores"`   // active restores failed
}

// Coordinator operations, the last tokens of <p>.coord.<op>.
const (
	CoordRegister      = "ns.register"    // dcp.Spec -> RegisterReply
	CoordLookup        = "lookup"         // LookupRequest -> LookupReply
	CoordRestoreBegin  = "restore.begin"  // RestoreBegin -> RestorePlan
	CoordRestoreReport = "restore.report" // RestoreReport -> ReportAck
	CoordRestoreWait   = "restore.wait"   // RestoreWait -> RestoreVerdict
	CoordRestoreCancel = "restore.cancel" // RestoreCancel -> CancelReply
)

// LookupRequest asks for the longest prefix of a chunk chain for which every
// expected shard's object has a copy the reading ranks can use (C5).
type LookupRequest struct {
	Namespace dcp.Namespace   `json:"namespace"`
	Chunks    []dcp.ChunkHash `json:"chunks"`
	// Instance is the engine instance whose ranks would restore. Empty: the
	// instance with the longest prefix (ties: the first by name).
	Instance string `json:"instance,omitempty"`
	// Detail asks for the source of every object of the prefix.
	Detail bool `json:"detail,omitempty"`
	// StateAtEnd asks for the prefix a restore.begin with StateAtEnd could
	// restore: every chunk of it needs its non-recurrent groups' objects,
	// a recurrent group's only its last chunk (a chunk stored without its
	// state does not end the prefix, it only cannot end it). The same rule
	// applies to restore.begin's own lookup when it sets StateAtEnd.
	StateAtEnd bool `json:"state_at_end,omitempty"`
}

// RestoreBeginRequest is what the coordinator accepts on restore.begin: a
// RestoreBegin, optionally naming the engine instance whose ranks restore
// (RestoreBegin has no such field). Without it the coordinator picks the
// instance with the longest restorable prefix, as for a lookup.
type RestoreBeginRequest struct {
	RestoreBegin
	Instance string `json:"instance,omitempty"`
	// PlanEncoding asks for the plan as PlanEncodingJSON (default, also
	// "") or PlanEncodingBinary (compact; see plan.go).
	PlanEncoding string `json:"plan_encoding,omitempty"`
	// StateAtEnd asks for the objects of the namespace's recurrent groups
	// (dcp.Recurrent: a Mamba or linear-attention state at a chunk's end)
	// only for the last chunk of the restored prefix: an engine resumes
	// from the state at the prefix's end and never reads the states inside
	// it (vLLM allocates a block for that one state only). The plan, the
	// expectations and the verdict then leave the inner chunks' recurrent
	// objects out, and its lookup needs a recurrent group's object for the
	// prefix's last chunk only (LookupRequest.StateAtEnd). Without effect
	// in a namespace whose groups are all recurrent or none is.
	StateAtEnd bool `json:"state_at_end,omitempty"`
	// Lookup says the begin is also the engine's lookup of the chain (one
	// round trip where a lookup and a begin took two): the coordinator
	// counts it as a lookup (the token hit ratio, admin.route's load), and
	// a begin that finds nothing restorable is answered a plan of prefix 0
	// without taking a restore slot or an entry in the restore history (a
	// miss is not a restore). A coordinator that predates it refuses the
	// request (an unknown field).
	Lookup bool `json:"lookup,omitempty"`
}

// ObjectPlacement is one rank's copy of an object.
type ObjectPlacement struct {
	Holder      Rank   `json:"holder"`
	Tier        Tier   `json:"tier"`
	Size        uint64 `json:"size"`
	Sum         uint64 `json:"sum"`
	Incarnation uint64 `json:"incarnation,omitempty"`
	Seq         uint64 `json:"seq,omitempty"`
}

// ObjectInfo is one object and copies of it.
type ObjectInfo struct {
	// Chunk is the chunk's index in the request's chain, -1 for an object
	// looked up by key.
	Chunk int     `json:"chunk"`
	Key   dcp.Key `json:"key"`
	// Reader is the rank that would read this copy (lookup detail only).
	Reader     string            `json:"reader,omitempty"`
	Placements []ObjectPlacement `json:"placements"`
}

// LookupReply answers a lookup: chunks [0, Prefix) are restorable by the
// ranks of Instance. With Detail, Sources lists, for every chunk of the
// prefix and every reading rank, the copy it would read.
type LookupReply struct {
	Instance string       `json:"instance,omitempty"`
	Prefix   int          `json:"prefix"`
	Sources  []ObjectInfo `json:"sources,omitempty"`
	// NotAlive lists the reader ranks of Instance (Rank.String()) that are
	// not alive (dead, left, fenced, absent from the cluster), and Reason
	// says why: Prefix still counts what is stored, but a restore.begin now
	// plans nothing.
	NotAlive []string `json:"not_alive,omitempty"`
	Reason   string   `json:"reason,omitempty"`
}

// ReportAck answers a restore report.
type ReportAck struct {
	// Duplicate: the rank had already reported; the report was ignored.
	Duplicate bool `json:"duplicate,omitempty"`
	// State is the restore's verdict state after this report.
	State string `json:"state"`
}

// AdminMembersReply lists the memberlist members the coordinator knows.
type AdminMembersReply struct {
	Members []AdminMember `json:"members"`
	// Raft, in a replicated cluster, is every coordinator's raft state as
	// collected by the admin CLI from admin.raft (one reply per node).
	Raft []AdminRaftNode `json:"raft,omitempty"`
}

// AdminMember is one memberlist member.
type AdminMember struct {
	Name        string    `json:"name"`
	ID          string    `json:"id"`
	Role        string    `json:"role"`
	State       string    `json:"state"` // alive | dead | left
	Addr        string    `json:"addr"`
	Incarnation uint64    `json:"incarnation"`
	Rank        string    `json:"rank,omitempty"` // instance/tp for a rankd
	NATS        []string  `json:"nats,omitempty"`
	Since       time.Time `json:"since"`
	Local       bool      `json:"local,omitempty"`
}

// AdminRanksReply lists every rank the index or the cluster knows.
type AdminRanksReply struct {
	Ranks []AdminRank `json:"ranks"`
}

// AdminRank is one rank: the index's view joined with memberlist's.
type AdminRank struct {
	Rank        Rank   `json:"rank"`
	Incarnation uint64 `json:"incarnation"`
	// Member is the memberlist ID of the member serving this rank, if any.
	Member string `json:"member,omitempty"`
	// Liveness is the memberlist state of the member with this rank and
	// incarnation: alive, dead, left, or unknown.
	Liveness  string `json:"liveness"`
	L1Objects int64  `json:"l1_objects"`
	L1Bytes   uint64 `json:"l1_bytes"`
	L2Objects int64  `json:"l2_objects"`
	L2Bytes   uint64 `json:"l2_bytes"`
	// L3Objects and L3Bytes are the objects this rank wrote to the object
	// store (L3) and reported, with their bytes.
	L3Objects int64  `json:"l3_objects"`
	L3Bytes   uint64 `json:"l3_bytes"`
	LastSeq   uint64 `json:"last_seq"`
	Fenced    bool   `json:"fenced,omitempty"` // its L1 placements are fenced
	Resync    bool   `json:"resync,omitempty"` // waiting for its inventory
}

// AdminObjectRequest looks objects up by key text, or by a chunk chain.
type AdminObjectRequest struct {
	Key       string          `json:"key,omitempty"`
	Namespace dcp.Namespace   `json:"namespace,omitzero"`
	Chunks    []dcp.ChunkHash `json:"chunks,omitempty"`
	Instance  string          `json:"instance,omitempty"`
}

// AdminObjectReply answers an object lookup. For a chain, Prefix is the
// prefix restorable by Instance's ranks, and Objects lists every object of
// every chunk asked about with every copy (none: missing). For a key,
// Prefix is -1.
type AdminObjectReply struct {
	Instance string       `json:"instance,omitempty"`
	Prefix   int          `json:"prefix"`
	Objects  []ObjectInfo `json:"objects"`
}

// AdminNamespacesReply lists registered namespaces with their usage.
type AdminNamespacesReply struct {
	Namespaces []AdminNamespace `json:"namespaces"`
}

// AdminNamespace is one registered namespace.
type AdminNamespace struct {
	Namespace   string `json:"namespace"` // hex
	Model       string `json:"model"`
	CacheSalt   string `json:"cache_salt,omitempty"`
	TP          int    `json:"tp"`
	DCP         int    `json:"dcp"`
	Groups      int    `json:"groups"`
	ChunkTokens int    `json:"chunk_tokens"`
	// Registered is false for a namespace known only from events (its
	// engine has not registered the spec yet); the spec fields are zero.
	Registered   bool   `json:"registered"`
	Chunks       int64  `json:"chunks"`
	Objects      int64  `json:"objects"`
	L1Placements int64  `json:"l1_placements"`
	L1Bytes      uint64 `json:"l1_bytes"`
	L2Placements int64  `json:"l2_placements"`
	L2Bytes      uint64 `json:"l2_bytes"`
}

// AdminRestoresReply lists the most recent verdicts, newest first.
type AdminRestoresReply struct {
	Restores []AdminRestore `json:"restores"`
}

// AdminRestore is one decided restore.
type AdminRestore struct {
	RestoreVerdict
	Namespace string `json:"namespace"` // hex
	// Instance is the engine instance that began the restore: only it may
	// read the verdict (restore.wait), before and after the decision.
	Instance string    `json:"instance,omitempty"`
	Ranks    int       `json:"ranks"`
	Began    time.Time `json:"began"`
	Decided  time.Time `json:"decided"`
	// VerdictLatencyUS is the time from the last report to the verdict, in
	// microseconds; -1 when the verdict came from the deadline.
	VerdictLatencyUS int64 `json:"verdict_latency_us"`
}

// AdminVerifyReply is the result of re-deriving the index's derived state
// from its placements and comparing.
type AdminVerifyReply struct {
	OK bool `json:"ok"`
	// Checked is the number of placements compared (= Placements).
	Checked    uint64   `json:"checked"`
	Namespaces int      `json:"namespaces"`
	Ranks      int      `json:"ranks"`
	Chunks     int64    `json:"chunks"`
	Placements int64    `json:"placements"`
	LogRecords int      `json:"log_records"`
	Mismatches []string `json:"mismatches,omitempty"`
}
