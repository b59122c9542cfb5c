package rankd

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// Limits on engine API requests: bad or hostile input is refused before it
// makes the daemon allocate or work without bound.
const (
	// MaxRequestBytes bounds one engine request body.
	MaxRequestBytes = 4 << 20
	// MaxChunksPerStore bounds the chunks of one store request.
	MaxChunksPerStore = 4096
	// MaxBlocksPerGroup bounds the block ids of one group of one chunk or
	// retrieve item.
	MaxBlocksPerGroup = 1 << 16
	// MaxItemsPerRetrieve bounds the items of one retrieve request.
	MaxItemsPerRetrieve = 1 << 16
	// MaxPools bounds the pools of one registration.
	MaxPools = 1 << 14
	// MaxIDBytes bounds request and restore ids.
	MaxIDBytes = 256
)

// decodeStrict unmarshals one JSON value: unknown fields, trailing data and
// bodies over MaxRequestBytes are errors that name the problem.
func decodeStrict(what string, data []byte, v any) error {
	if len(data) > MaxRequestBytes {
		return fmt.Errorf("%s request of %d B exceeds %d B: %w", what, len(data), MaxRequestBytes, ErrTooLarge)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decode %s request: %w", what, errors.Join(err, ErrBadRequest))
	}
	if dec.More() {
		return fmt.Errorf("decode %s request: trailing data after the JSON object: %w", what, ErrBadRequest)
	}
	return nil
}

func badf(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, ErrBadRequest)...)
}

func checkID(what, id string, required bool) error {
	switch {
	case id == "" && required:
		return badf("%s is empty", what)
	case len(id) > MaxIDBytes:
		return badf("%s is %d B, limit %d B", what, len(id), MaxIDBytes)
	}
	return nil
}

// checkBlocks checks one list of block ids; what names it in an error (a
// function, so that the valid path formats nothing).
func checkBlocks(ids []int64, what func() string) error {
	if len(ids) > MaxBlocksPerGroup {
		return fmt.Errorf("%s lists %d block ids, limit %d: %w", what(), len(ids), MaxBlocksPerGroup, ErrTooLarge)
	}
	for i, id := range ids {
		if id < 0 {
			return badf("%s: block id %d at index %d is negative", what(), id, i)
		}
	}
	return nil
}

// binaryLimits are the limits above for the binary request decoders.
var binaryLimits = wire.RequestLimits{MaxChunks: MaxChunksPerStore, MaxItems: MaxItemsPerRetrieve, MaxBlocks: MaxBlocksPerGroup}

// decodeBinary decodes a binary engine request (wire/reqbin.go) of at most
// MaxRequestBytes: a count over a limit is ErrTooLarge, other bad input
// ErrBadRequest, as for JSON.
func decodeBinary[T any](what string, data []byte, dec func([]byte, wire.RequestLimits) (*T, error)) (*T, error) {
	if len(data) > MaxRequestBytes {
		return nil, fmt.Errorf("%s request of %d B exceeds %d B: %w", what, len(data), MaxRequestBytes, ErrTooLarge)
	}
	v, err := dec(data, binaryLimits)
	switch {
	case errors.Is(err, wire.ErrOverLimit):
		return nil, fmt.Errorf("decode %s request: %w: %w", what, err, ErrTooLarge)
	case err != nil:
		return nil, fmt.Errorf("decode %s request: %w: %w", what, err, ErrBadRequest)
	}
	return v, nil
}

// DecodeRegisterRequest decodes and validates a register request: the spec
// must resolve (layout and geometry rules, C2) and every pool must name a
// group and layer of it, once.
func DecodeRegisterRequest(data []byte) (*wire.RegisterRequest, *dcp.Resolved, error) {
	var req wire.RegisterRequest
	if err := decodeStrict("register", data, &req); err != nil {
		return nil, nil, err
	}
	r, err := req.Spec.Resolve()
	if err != nil {
		return nil, nil, fmt.Errorf("register: spec: %w", err)
	}
	if len(req.Pools) > MaxPools {
		return nil, nil, fmt.Errorf("register: %d pools, limit %d: %w", len(req.Pools), MaxPools, ErrTooLarge)
	}
	want := 0
	for _, g := range r.Groups {
		want += g.Layers
	}
	seen := make(map[[2]int]bool, len(req.Pools))
	for i, p := range req.Pools {
		if p.Group < 0 || p.Group >= len(r.Groups) {
			return nil, nil, badf("register: pool %d names group %d, the spec has %d", i, p.Group, len(r.Groups))
		}
		if l := r.Groups[p.Group].Layers; p.Layer < 0 || p.Layer >= l {
			return nil, nil, badf("register: pool %d names layer %d of group %d, which has %d layers", i, p.Layer, p.Group, l)
		}
		if seen[[2]int{p.Group, p.Layer}] {
			return nil, nil, badf("register: pool %d repeats group %d layer %d", i, p.Group, p.Layer)
		}
		seen[[2]int{p.Group, p.Layer}] = true
		if p.Handle.Size == 0 || p.Handle.Backend == "" {
			return nil, nil, badf("register: pool %d (group %d layer %d) has an empty IPC handle", i, p.Group, p.Layer)
		}
		if need := r.Geometry[p.Group].PageBytes; p.Handle.Size < need {
			return nil, nil, fmt.Errorf("register: pool %d (group %d layer %d) of %d B cannot hold one %d B page: %w",
				i, p.Group, p.Layer, p.Handle.Size, need, dcp.ErrGeometry)
		}
	}
	if len(req.Pools) != want {
		return nil, nil, badf("register: %d pools, the spec has %d (one per layer of every group)", len(req.Pools), want)
	}
	return &req, r, nil
}

// DecodeStoreRequest decodes and validates the shape of a store request,
// JSON or binary (wire.IsBinaryStore); both forms pass the same checks.
// Whether the blocks fit the registered pools is the transfer engine's check.
func DecodeStoreRequest(data []byte) (*wire.StoreRequest, error) {
	if wire.IsBinaryStore(data) {
		req, err := decodeBinary("store", data, wire.DecodeStoreBinary)
		if err != nil {
			return nil, err
		}
		return checked(req, checkStore(req))
	}
	var req wire.StoreRequest
	if err := decodeStrict("store", data, &req); err != nil {
		return nil, err
	}
	return checked(&req, checkStore(&req))
}

// checked returns v, or nil and err when err is set.
func checked[T any](v *T, err error) (*T, error) {
	if err != nil {
		return nil, err
	}
	return v, nil
}

// checkStore validates a decoded store request.
func checkStore(req *wire.StoreRequest) error {
	if err := checkID("store request id", req.RequestID, true); err != nil {
		return err
	}
	if req.Namespace == (dcp.Namespace{}) {
		return badf("store %s: namespace is missing", req.RequestID)
	}
	switch {
	case len(req.Chunks) == 0:
		return badf("store %s: no chunks", req.RequestID)
	case len(req.Chunks) > MaxChunksPerStore:
		return fmt.Errorf("store %s: %d chunks, limit %d: %w", req.RequestID, len(req.Chunks), MaxChunksPerStore, ErrTooLarge)
	case req.Event.Backend == "" || len(req.Event.Raw) == 0:
		return badf("store %s: no producer event handle (the engine must record one per store, C1)", req.RequestID)
	}
	for i, c := range req.Chunks {
		if len(c.Blocks) == 0 || len(c.Blocks) > dcp.MaxGroups {
			return badf("store %s: chunk %d has block lists for %d groups, want 1..%d", req.RequestID, i, len(c.Blocks), dcp.MaxGroups)
		}
		for g, ids := range c.Blocks {
			if err := checkBlocks(ids, func() string { return fmt.Sprintf("store %s chunk %d group %d", req.RequestID, i, g) }); err != nil {
				return err
			}
		}
	}
	return nil
}

// DecodeRetrieveRequest decodes and validates the shape of a retrieve
// request, JSON or binary (wire.IsBinaryRetrieve): every item's key is in
// the request's namespace and names the item's group, and every item has
// target blocks.
func DecodeRetrieveRequest(data []byte) (*wire.RetrieveRequest, error) {
	if wire.IsBinaryRetrieve(data) {
		req, err := decodeBinary("retrieve", data, wire.DecodeRetrieveBinary)
		if err != nil {
			return nil, err
		}
		return checked(req, checkRetrieve(req))
	}
	var req wire.RetrieveRequest
	if err := decodeStrict("retrieve", data, &req); err != nil {
		return nil, err
	}
	return checked(&req, checkRetrieve(&req))
}

// checkRetrieve validates a decoded retrieve request.
func checkRetrieve(req *wire.RetrieveRequest) error {
	if err := checkID("restore id", req.RestoreID, false); err != nil {
		return err
	}
	if req.Namespace == (dcp.Namespace{}) {
		return badf("retrieve: namespace is missing")
	}
	switch {
	case len(req.Items) == 0:
		return badf("retrieve: no items")
	case len(req.Items) > MaxItemsPerRetrieve:
		return fmt.Errorf("retrieve: %d items, limit %d: %w", len(req.Items), MaxItemsPerRetrieve, ErrTooLarge)
	}
	for i := range req.Items {
		it := &req.Items[i]
		switch {
		case it.Key.NS != req.Namespace:
			return badf("retrieve: item %d key %s is not in namespace %s", i, it.Key, req.Namespace)
		case it.Chunk < 0:
			return badf("retrieve: item %d chunk index %d is negative", i, it.Chunk)
		case it.Group < 0 || it.Group != int(it.Key.Group):
			return badf("retrieve: item %d group %d does not match its key's group %d", i, it.Group, it.Key.Group)
		case len(it.Blocks) == 0:
			return badf("retrieve: item %d (chunk %d group %d) has no target blocks", i, it.Chunk, it.Group)
		case it.Source.Tier != 0 && !it.Source.Tier.Valid():
			return badf("retrieve: item %d source tier %d", i, it.Source.Tier)
		}
		if err := checkBlocks(it.Blocks, func() string { return fmt.Sprintf("retrieve item %d", i) }); err != nil {
			return err
		}
	}
	return nil
}
