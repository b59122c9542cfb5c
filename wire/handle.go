package wire

// MemHandle names exported device memory for another process. It is plain
// data (it travels as JSON over NATS): the cuda package aliases it, so wire
// and everything that only speaks the protocol (index, coordinator) never
// link the device code (STYLE 25).
type MemHandle struct {
	Backend string `json:"backend"` // "host" or "cuda"
	Device  string `json:"device"`  // UUID of the device that owns the memory
	Raw     []byte `json:"raw"`     // backend-specific handle bytes
	Offset  uint64 `json:"offset"`  // start of the view in the base allocation
	Size    uint64 `json:"size"`    // length of the view
}

// EventHandle names an exported interprocess event. Plain data, aliased by
// the cuda package like MemHandle.
type EventHandle struct {
	Backend string `json:"backend"` // "host" or "cuda"
	Device  string `json:"device"`  // UUID of the device that recorded it
	Raw     []byte `json:"raw"`     // backend-specific handle bytes
}
