package wire

import "github.com/kvtier/kvtier/dcp"

// Routing hints (issue 26.4, docs/sharing.md): for a prompt's chunk
// chain, which instance of a share group can restore the longest prefix,
// and from which tier, so a router can send the request where its cache
// is. A read-only admin operation: a router holds the admin identity.
const AdminRoute = "route" // RouteRequest -> RouteReply

// RouteRequest asks which instance of a share group holds the longest
// prefix of Chunks in Namespace: the group named by Group, or Instance
// and the other members of its group (Instance alone when it is in
// none). Both set: Instance must be in Group.
type RouteRequest struct {
	Namespace dcp.Namespace   `json:"namespace"`
	Chunks    []dcp.ChunkHash `json:"chunks"`
	Group     string          `json:"group,omitempty"`
	Instance  string          `json:"instance,omitempty"`
	// Stages are a pipeline-parallel engine's other stages, in order
	// (stage 1, 2, ...): each stage's namespace and its chain of the same
	// tokens (a stage's chain starts from its own namespace). With Stages,
	// Namespace and Chunks are stage 0's, Group or Instance names stage
	// 0's group or instance (StageInstance(engine, pp, 0)), and each
	// member's answer is for its engine: what every stage could restore
	// (RouteInstance.Engine). The number of stages is the caller's word for
	// the engine's PP size: a stage left out makes the answer too hopeful,
	// never wrong about bytes (the engine checks every stage). Every
	// stage's chain counts against the request's chunk limit.
	Stages []RouteStage `json:"stages,omitempty"`
}

// RouteStage is one more pipeline stage of a RouteRequest.
type RouteStage struct {
	Namespace dcp.Namespace   `json:"namespace"`
	Chunks    []dcp.ChunkHash `json:"chunks"`
}

// MaxRouteStages bounds RouteRequest.Stages.
const MaxRouteStages = 63

// RouteReply lists every instance of the group, best first: the longest
// Prefix, then the longest L1Prefix, then the lower Load's power of two
// (loads within a factor of two tie), then the longest OwnPrefix, then
// the lower Load, then by name.
type RouteReply struct {
	Group     string          `json:"group,omitempty"`
	Instances []RouteInstance `json:"instances"`
}

// RouteInstance is what one instance could restore of the chain now.
type RouteInstance struct {
	Instance string `json:"instance"`
	// Engine is set when the request named Stages: the engine whose stage
	// 0 Instance is, and the fields below are over all its stages: the
	// prefixes the shortest stage's, the objects, shared objects, hosts
	// and reader ranks not alive every stage's together, the load stage
	// 0's (the engine's lookups start there).
	Engine string `json:"engine,omitempty"`
	// Prefix is the chunks a restore by this instance would plan (its own
	// copies and the group's shared L2 copies), as its lookup reports.
	Prefix int `json:"prefix"`
	// L1Prefix counts the leading chunks every reader rank would read
	// from L1 (its own or, with host-shared L1, a rank of its instance):
	// restored from DRAM on the instance's hosts (Hosts).
	L1Prefix int `json:"l1_prefix"`
	// OwnPrefix counts the leading chunks restored from the instance's
	// own copies only (no other member's).
	OwnPrefix int `json:"own_prefix"`
	// Objects counts the planned objects of the prefix by the tier they
	// would be read from ("L1", "L2", "L3"); Shared those of them held by
	// another member (its L2).
	Objects map[string]int `json:"objects,omitempty"`
	Shared  int            `json:"shared,omitempty"`
	// Load is the rate of the instance's engine lookups, per second (a
	// count decayed with a time constant of 1 s; 0 outside a share group):
	// each request an engine serves starts with a lookup.
	Load float64 `json:"load"`
	// Hosts are the hosts of the instance's live rankds.
	Hosts []string `json:"hosts,omitempty"`
	// NotAlive lists its reader ranks that are not alive: a restore now
	// would plan nothing (LookupReply.NotAlive).
	NotAlive []string `json:"not_alive,omitempty"`
}
