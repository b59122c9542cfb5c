package campaign

import (
	"bufio"
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"os"
)

// Trace geometry: the Mooncake trace names one hash id per 512-token
// block; the engine scenarios store 2048-token chunks.
const (
	traceBlockTokens = 512
	chunkTokens      = 2048
	vocab            = 151936
)

// traceRequest is one line of the Mooncake trace.
type traceRequest struct {
	InputLength int      `json:"input_length"`
	HashIDs     []uint64 `json:"hash_ids"`
}

// sampleTrace is the first 1,000 requests of the Mooncake trace
// (testdata/README.md), used when the full trace is not found.
//
//go:embed testdata/mooncake_sample.jsonl
var sampleTrace []byte

// sampleTraceName names sampleTrace in errors and reports.
const sampleTraceName = "built-in sample (first 1,000 requests of the Mooncake trace)"

// loadTrace reads the requests of the trace at path; path "" reads the
// built-in sample.
func loadTrace(path string) ([]traceRequest, error) {
	var rd io.Reader = bytes.NewReader(sampleTrace)
	if path != "" {
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("trace: %w", err)
		}
		defer f.Close()
		rd = f
	} else {
		path = sampleTraceName
	}
	var out []traceRequest
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for line := 1; sc.Scan(); line++ {
		var r traceRequest
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("trace %s line %d: %w", path, line, err)
		}
		out = append(out, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace %s: %w", path, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("trace %s: no requests", path)
	}
	return out, nil
}

func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// PromptTokens turns a trace request into token ids: the 512 tokens of a
// block are a function of its hash id alone, so requests whose hash ids
// agree on a prefix agree on those tokens (and so on their chunk keys).
// The prompt keeps at most maxChunks full 2048-token chunks and a tail of
// at most 511 tokens; nil when the request has no full chunk.
func PromptTokens(input int, hashIDs []uint64, maxChunks int) []uint32 {
	n := min(input, len(hashIDs)*traceBlockTokens)
	full := min(n/chunkTokens, maxChunks)
	if full == 0 {
		return nil
	}
	tail := min(n-full*chunkTokens, traceBlockTokens-1)
	out := make([]uint32, 0, full*chunkTokens+tail)
	for i := range full*chunkTokens + tail {
		h := hashIDs[i/traceBlockTokens]
		out = append(out, uint32(mix64(h<<9|uint64(i%traceBlockTokens))%vocab))
	}
	return out
}
