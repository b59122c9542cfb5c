package wire

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvtier/kvtier/dcp"
)

// Error codes that cross the wire. They are stable: clients switch on them.
const (
	CodeBadRequest       = "bad_request"       // malformed or invalid input
	CodeUnknownNamespace = "unknown_namespace" // namespace never registered
	CodeGeometry         = "geometry"          // geometry rule failed (C2)
	CodeNotFound         = "not_found"         // no such object, restore or rank
	CodeTooLarge         = "too_large"         // request over a size limit
	CodeUnavailable      = "unavailable"       // shutting down, or a dependency is down
	CodeInternal         = "internal"          // a bug or an I/O failure; logged
	CodeUnauthorized     = "unauthorized"      // the body names another identity than the caller's (C9)
)

// Error is the error reply of every request/reply operation.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// RetryAfterMS, with code unavailable, is how long the sender suggests
	// waiting before the same request is sent again (a coordinator still
	// opening its index sets it); 0: no hint, the caller's own backoff.
	RetryAfterMS int `json:"retry_after_ms,omitempty"`
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// Retryable reports whether the same request may succeed when sent again:
// code unavailable (shutting down, starting, a dependency down) and
// internal (an I/O failure that may pass). Every other code is final for
// that request.
func (e *Error) Retryable() bool { return e.Code == CodeUnavailable || e.Code == CodeInternal }

// RetryAfter is the sender's retry hint, or def when it gave none.
func (e *Error) RetryAfter(def time.Duration) time.Duration {
	if e.RetryAfterMS > 0 {
		return time.Duration(e.RetryAfterMS) * time.Millisecond
	}
	return def
}

// Reply wraps every JSON reply: exactly one of Error or the payload is set.
type Reply[T any] struct {
	Error *Error `json:"error,omitempty"`
	OK    *T     `json:"ok,omitempty"`
}

// EventAck answers an event batch once the coordinator has committed it.
type EventAck struct {
	// AppliedThrough is the highest sequence of this incarnation now durable.
	AppliedThrough uint64 `json:"applied_through"`
	// Resync asks the rank for its inventory: the batch started past a gap.
	Resync bool `json:"resync,omitempty"`
	// Fenced: the batch came from a superseded incarnation and was dropped.
	Fenced bool `json:"fenced,omitempty"`
}

// PoolRegistration is one layer's KV pool of one group.
type PoolRegistration struct {
	Group  int       `json:"group"`
	Layer  int       `json:"layer"`
	Handle MemHandle `json:"handle"`
}

// RegisterRequest registers an engine's KV pools with its rankd.
type RegisterRequest struct {
	Spec       dcp.Spec           `json:"spec"`
	DeviceUUID string             `json:"device_uuid"`
	Pools      []PoolRegistration `json:"pools"`
}

// RegisterReply confirms a registration.
type RegisterReply struct {
	Namespace dcp.Namespace `json:"namespace"`
	// Session names this registration (32 hex characters, 128 random
	// bits); every later store, retrieve and release of the engine process
	// sends it. See session.go. Empty in the coordinator's ns.register
	// reply (namespaces have no sessions).
	Session string `json:"session,omitempty"`
	// Superseded is the session this registration replaced ("" if none):
	// its later requests are refused with CodeStaleSession.
	Superseded string `json:"superseded,omitempty"`
}

// ChunkBlocks names one chunk and, per group, the block ids that hold it.
type ChunkBlocks struct {
	Chunk  dcp.ChunkHash `json:"chunk"`
	Blocks [][]int64     `json:"blocks"` // [group][block]
	// Pos is the chunk's index in the prompt (0-based; 0 also when the
	// engine does not say). An engine stores a prompt's chunks in
	// concurrent requests, so their arrival order is not their order: a
	// rank whose L2 bound is smaller than the prompt keeps the prompt's
	// lowest positions there (its prefix, what a restore needs).
	Pos uint32 `json:"pos,omitempty"`
}

// StoreRequest asks a rankd to store chunks from the engine's pages once the
// engine's producer event has completed.
type StoreRequest struct {
	RequestID string        `json:"request_id"`
	Namespace dcp.Namespace `json:"namespace"`
	Session   string        `json:"session"` // RegisterReply.Session of the engine's registration
	Chunks    []ChunkBlocks `json:"chunks"`
	Event     EventHandle   `json:"event"`
}

// StoreReply answers a store once the device has read the pages (the engine
// may reuse the blocks) and the objects are committed in L1.
type StoreReply struct {
	Stored  int      `json:"stored"`  // objects committed by this store
	Deduped int      `json:"deduped"` // objects already held
	Failed  []string `json:"failed,omitempty"`
	// BlocksInUse: the store ended (timed out) and the device may still
	// be reading the blocks after a further wait; the engine must not
	// reuse them or destroy its producer event until the rankd publishes
	// BlocksFreed for this store on Subjects.Freed (C10).
	BlocksInUse bool `json:"blocks_in_use,omitempty"`
	// NotDurable, when set, says why the stored objects are in L1 only
	// although the policy (write-through) promises L2: the tier is
	// failing or its directory is gone. The store itself succeeded.
	NotDurable string `json:"not_durable,omitempty"`
}

// Source says where a reader should take an object from.
type Source struct {
	Holder Rank `json:"holder"`
	Tier   Tier `json:"tier"`
}

// RetrieveItem is one object to place: chunk index in the restore, group,
// key, expected checksum, source and target block ids.
type RetrieveItem struct {
	Chunk  int     `json:"chunk"`
	Group  int     `json:"group"`
	Key    dcp.Key `json:"key"`
	Sum    uint64  `json:"sum"`
	Source Source  `json:"source"`
	Blocks []int64 `json:"blocks"`
	// Skip is how many of the chunk's first blocks the engine holds
	// already (its own prefix cache ends inside the chunk): their pages,
	// of every layer, are not placed, and Blocks are the target ids of the
	// chunk's blocks Skip.. only. The whole object is still verified
	// against Sum (the skipped pages over the source bytes). A rankd from
	// before Skip refuses the field (JSON: an unknown field; binary: KVR2),
	// so it never writes a page the engine did not ask for.
	Skip int `json:"skip,omitempty"`
}

// RetrieveRequest asks a rankd to place objects into the engine's pages.
// With RestoreID set, the rankd reports the results to the coordinator.
type RetrieveRequest struct {
	RestoreID string         `json:"restore_id,omitempty"`
	Namespace dcp.Namespace  `json:"namespace"`
	Session   string         `json:"session"` // RegisterReply.Session of the engine's registration
	Items     []RetrieveItem `json:"items"`
}

// ItemResult is the outcome of one placed object.
type ItemResult struct {
	Chunk  int    `json:"chunk"`
	Group  int    `json:"group"`
	OK     bool   `json:"ok"`
	Sum    uint64 `json:"sum"`              // kvsum64 of the bytes the scatter stored (not read back); never 0 when OK
	Reason string `json:"reason,omitempty"` // missing | corrupt | timeout | device | ...
}

// RetrieveReply answers once the device has finished placing bytes.
type RetrieveReply struct {
	Results []ItemResult `json:"results"`
}

// HeaderResults is the NATS header of a retrieve request that asks for
// fewer results in its reply: ResultsFailed lists only the items that
// failed (an engine that waits for the coordinator's verdict reads no
// more; a 2,048-item reply was ~120 KB of JSON). The rank's report to the
// coordinator still carries every item. A rank that predates the header
// ignores it and replies with every result.
const HeaderResults = "Kvtier-Results"

// ResultsFailed is the HeaderResults value asking for the failed items
// only.
const ResultsFailed = "failed"

// OnlyFailed returns r with the failed items' results only.
func (r RetrieveReply) OnlyFailed() RetrieveReply {
	out := RetrieveReply{Results: []ItemResult{}}
	for _, it := range r.Results {
		if !it.OK {
			out.Results = append(out.Results, it)
		}
	}
	return out
}

// RestoreBegin asks the coordinator for a restore plan.
type RestoreBegin struct {
	Namespace  dcp.Namespace   `json:"namespace"`
	Chunks     []dcp.ChunkHash `json:"chunks"`
	DeadlineMS int             `json:"deadline_ms,omitempty"`
}

// RestorePlan is the coordinator's answer: the restorable prefix and, for
// every rank, what to read from where.
type RestorePlan struct {
	RestoreID string                    `json:"restore_id"`
	Prefix    int                       `json:"prefix"` // chunks [0, Prefix) are planned
	Ranks     map[string][]RetrieveItem `json:"ranks"`  // by Rank.String(); Blocks left empty
	// Reason, when set, says why less was planned than is stored: nothing
	// (Prefix 0) because a reader rank is not alive, or a prefix cut short
	// before a chunk whose recorded sum is 0 (it could not be checked).
	Reason string `json:"reason,omitempty"`
}

// RestoreReport is a rank's report of what it placed.
type RestoreReport struct {
	RestoreID string       `json:"restore_id"`
	Rank      Rank         `json:"rank"`
	Results   []ItemResult `json:"results"`
}

// RestoreWait asks for the verdict, waiting up to the restore's deadline.
type RestoreWait struct {
	RestoreID string `json:"restore_id"`
}

// RestoreCancel withdraws a begun restore whose retrieves the engine never
// sent (vLLM did not schedule the request before it finished, or the
// connector began it again): the coordinator decides it failed at once,
// counted as cancelled, and frees its slot, rather than failing it at its
// deadline as if the ranks had not answered. A restore some rank already
// reported for is not cancelled (CancelReply.Cancelled false): its reads
// ran, and it is decided as any. Only the restore's own instance may cancel it.
type RestoreCancel struct {
	RestoreID string `json:"restore_id"`
}

// CancelReply answers a RestoreCancel: whether it was cancelled, and the
// restore's state after the request ("failed" once cancelled or decided).
type CancelReply struct {
	Cancelled bool   `json:"cancelled"`
	State     string `json:"state"`
}

// Verdict states.
const (
	VerdictPending  = "pending"
	VerdictComplete = "complete"
	VerdictFailed   = "failed"
	// VerdictRefused: the coordinator planned nothing although chunks are
	// stored (a reader rank is not alive, ...); Reason says why. Nothing
	// was restored and nothing was checked: it is never complete.
	VerdictRefused = "refused"
)

// RestoreVerdict is the coordinator's final word on a restore (C5).
type RestoreVerdict struct {
	RestoreID string   `json:"restore_id"`
	State     string   `json:"state"`
	Prefix    int      `json:"prefix"`
	Failed    []int    `json:"failed,omitempty"`  // chunk indexes, sorted
	Reasons   []string `json:"reasons,omitempty"` // Reasons[i]: why Failed[i] failed (its first failed expectation)
	// GroupReasons, when set, is parallel to Failed: GroupReasons[i] names
	// why each group of chunk Failed[i] that failed did, by group
	// ascending ("rank 0 group 1 shard 0: corrupt"), one entry per group,
	// and an entry whose bytes were wrong (corrupt, a checksum mismatch,
	// sum 0) is kept over one that was only missing or late (issue 27).
	// The coordinator leaves it out when no chunk failed in more than one
	// group (Reasons then says it all), as coordinators before it did:
	// read it through ChunkReasons.
	GroupReasons [][]string `json:"group_reasons,omitempty"`
	// Reason says why a refused restore was refused; empty otherwise.
	Reason string `json:"reason,omitempty"`
}

// ChunkReasons returns why Failed[i] failed: every failed group's reason
// when the verdict carries them, else its one reason (without Reasons'
// "chunk N: " prefix, which names Failed[i] again); nil for an index
// outside Failed or a verdict without reasons.
func (v *RestoreVerdict) ChunkReasons(i int) []string {
	switch {
	case i < 0 || i >= len(v.Failed):
		return nil
	case i < len(v.GroupReasons):
		return v.GroupReasons[i]
	case i < len(v.Reasons):
		return []string{strings.TrimPrefix(v.Reasons[i], fmt.Sprintf("chunk %d: ", v.Failed[i]))}
	}
	return nil
}

// FailedReasons is one line per failed chunk naming every failed group's
// reason ("chunk 3: rank 0 group 0 shard 0: missing; rank 0 group 1 shard 0:
// corrupt"), for logs and results; Reasons holds the first group's only.
// A refused verdict fails no chunk: its Reasons are returned as they are.
func (v *RestoreVerdict) FailedReasons() []string {
	if len(v.Failed) == 0 {
		return v.Reasons
	}
	out := make([]string, 0, len(v.Failed))
	for i, c := range v.Failed {
		out = append(out, fmt.Sprintf("chunk %d: %s", c, strings.Join(v.ChunkReasons(i), "; ")))
	}
	return out
}

// Validate checks a verdict is self-consistent: complete has no failures;
// refused has prefix 0, a reason and no failed chunks.
func (v *RestoreVerdict) Validate() error {
	switch v.State {
	case VerdictPending, VerdictComplete, VerdictFailed, VerdictRefused:
	default:
		return fmt.Errorf("verdict %s has state %q, want pending, complete, failed or refused: %w", v.RestoreID, v.State, ErrMalformed)
	}
	if v.State == VerdictComplete && len(v.Failed) > 0 {
		return fmt.Errorf("verdict %s complete with %d failed chunks: %w", v.RestoreID, len(v.Failed), ErrMalformed)
	}
	if v.State == VerdictRefused && (v.Prefix != 0 || v.Reason == "" || len(v.Failed) > 0) {
		return fmt.Errorf("verdict %s refused with prefix %d, %d failed chunks and reason %q; want prefix 0, none and a reason: %w",
			v.RestoreID, v.Prefix, len(v.Failed), v.Reason, ErrMalformed)
	}
	if v.State != VerdictRefused && v.Reason != "" {
		return fmt.Errorf("verdict %s is %s with a refusal reason %q: %w", v.RestoreID, v.State, v.Reason, ErrMalformed)
	}
	if len(v.GroupReasons) > 0 && len(v.GroupReasons) != len(v.Failed) {
		return fmt.Errorf("verdict %s has group reasons for %d chunks, want one list per failed chunk (%d): %w",
			v.RestoreID, len(v.GroupReasons), len(v.Failed), ErrMalformed)
	}
	return nil
}
