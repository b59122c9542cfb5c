package wire

import (
	"strconv"

	"github.com/kvtier/kvtier/dcp"
)

// BlocksFreed is published by a rankd on Subjects.Freed when the device has
// stopped reading the blocks of a store it answered with BlocksInUse (C10):
// only then may the engine reuse those blocks or destroy the store's
// producer event. It is plain JSON, published (no reply). A store is named
// by its request id and its chunks, in request order: several stores may
// share a request id, never the same chunks at once.
type BlocksFreed struct {
	Rank      Rank            `json:"rank"`
	RequestID string          `json:"request_id"`
	Namespace dcp.Namespace   `json:"namespace"`
	Chunks    []dcp.ChunkHash `json:"chunks"`
}

// Freed is where rank r announces BlocksFreed to its engine worker:
// <p>.rank.<instance>.<tp>.freed (rankd publishes, the engine subscribes).
func (s Subjects) Freed(r Rank) string {
	return s.p() + ".rank." + r.Instance + "." + strconv.Itoa(r.TPRank) + ".freed"
}
