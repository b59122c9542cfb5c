package wire

// Timeline is where the time of one engine request went on a rank: the
// stages a rankd measured for a store or a retrieve (the rankd's status
// reply carries recent ones on request; enginesim --bench prints them).
// Host stages follow one another without gaps from the receipt of the
// request; device stages (Device) overlap them.
type Timeline struct {
	// Op is "store" or "retrieve".
	Op string `json:"op"`
	// ID is the request's RequestID (store) or RestoreID (retrieve).
	ID string `json:"id"`
	// StartUnixNS is the rankd's wall clock at the receipt of the request
	// (ns since the Unix epoch): comparable with another process's clock
	// on the same host only.
	StartUnixNS int64 `json:"start_unix_ns"`
	// DurNS is the time from the receipt to the reply sent.
	DurNS int64 `json:"dur_ns"`
	// Bytes are the bytes the request moved (gathered or scattered).
	Bytes uint64 `json:"bytes"`
	// Truncated: stages beyond the rankd's limit per request were left out.
	Truncated bool `json:"truncated,omitempty"`
	// MarkClampNS is the most a mark after a copy was moved back to the
	// moment the host saw the copy complete (it was reached later than
	// that; 0: none was).
	MarkClampNS int64           `json:"mark_clamp_ns,omitempty"`
	Stages      []TimelineStage `json:"stages"`
}

// TimelineStage is one stage of a Timeline.
type TimelineStage struct {
	Name string `json:"name"`
	// Batch is the copy batch (from 0); -1 for a stage of the request.
	Batch int `json:"batch"`
	// Device: a stage of the device (timed with CUDA events on a GPU),
	// overlapping the host stages.
	Device bool `json:"device,omitempty"`
	// StartNS and DurNS are offsets from the receipt.
	StartNS int64 `json:"start_ns"`
	DurNS   int64 `json:"dur_ns"`
}
