package wire

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

func sampleBegin() *RestoreBeginRequest {
	return &RestoreBeginRequest{RestoreBegin: RestoreBegin{Namespace: dcp.Namespace{7, 1},
		Chunks: []dcp.ChunkHash{{1, 2}, {3}, {0xff}}, DeadlineMS: 2500}, Instance: "eng-1",
		PlanEncoding: PlanEncodingBinary, Lookup: true}
}

func sampleReport() *RestoreReport {
	return &RestoreReport{RestoreID: "r-0000000a", Rank: Rank{Instance: "eng-1", TPRank: 3}, Results: []ItemResult{
		{Chunk: 0, Group: 1, OK: true, Sum: 0xfedcba9876543210},
		{Chunk: math.MaxUint32, Group: math.MaxUint16, Reason: "corrupt: sum 0x1 ≠ 0x2"},
		{Chunk: 5, Group: 0, Reason: ""},
	}}
}

// TestBinaryBeginAndReport: both forms carry every field exactly (JSON
// and binary of one value decode alike), every truncation and trailing
// byte and every out-of-range field is refused with ErrMalformed, and the
// encoders refuse what the form cannot carry.
func TestBinaryBeginAndReport(t *testing.T) {
	for _, b := range []*RestoreBeginRequest{sampleBegin(), {}, {StateAtEnd: true, PlanEncoding: PlanEncodingJSON}} {
		p, err := b.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		var back RestoreBeginRequest
		want := *b
		if want.PlanEncoding == PlanEncodingJSON {
			want.PlanEncoding = "" // the default, one bit
		}
		if want.Chunks == nil {
			want.Chunks = []dcp.ChunkHash{}
		}
		if err := back.UnmarshalBinary(p); err != nil || !reflect.DeepEqual(back, want) {
			t.Fatalf("begin %+v decodes to %+v, %v", want, back, err)
		}
		malformedPrefixes(t, "begin", p, func(q []byte) error { var r RestoreBeginRequest; return r.UnmarshalBinary(q) })
	}
	r := sampleReport()
	p, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var back RestoreReport
	if err := back.UnmarshalBinary(p); err != nil || !reflect.DeepEqual(&back, r) {
		t.Fatalf("report decodes to %+v, %v", back, err)
	}
	malformedPrefixes(t, "report", p, func(q []byte) error { var r RestoreReport; return r.UnmarshalBinary(q) })

	// Out of range in the bytes: flags, ok, a count beyond the bytes,
	// invalid UTF-8.
	bp, _ := sampleBegin().MarshalBinary()
	okAt := len(reportMagic) + 2 + len(r.RestoreID) + 1 + len(r.Rank.Instance) + 2 + 4 + 6
	for name, tc := range map[string]struct {
		p    []byte
		at   int
		v    byte
		want string
		dec  func([]byte) error
	}{
		"begin flags":     {bp, 4, 0x08, "unknown flags", func(q []byte) error { var r RestoreBeginRequest; return r.UnmarshalBinary(q) }},
		"begin instance":  {bp, 22, 0xff, "not UTF-8", func(q []byte) error { var r RestoreBeginRequest; return r.UnmarshalBinary(q) }},
		"report ok":       {p, okAt, 2, "ok 2", func(q []byte) error { var r RestoreReport; return r.UnmarshalBinary(q) }},
		"report count":    {p, okAt - 7, 0xff, "hold at most", func(q []byte) error { var r RestoreReport; return r.UnmarshalBinary(q) }},
		"report instance": {p, len(reportMagic) + 2 + len(r.RestoreID) + 1, 0xff, "not UTF-8", func(q []byte) error { var r RestoreReport; return r.UnmarshalBinary(q) }},
	} {
		q := append([]byte(nil), tc.p...)
		q[tc.at] = tc.v
		if err := tc.dec(q); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}

	// What the forms cannot carry: the encoders refuse it (send JSON).
	for name, b := range map[string]*RestoreBeginRequest{
		"long instance":     {Instance: strings.Repeat("a", 65)},
		"negative deadline": {RestoreBegin: RestoreBegin{DeadlineMS: -1}},
		"huge deadline":     {RestoreBegin: RestoreBegin{DeadlineMS: math.MaxUint32 + 1}},
		"plan encoding":     {PlanEncoding: "xml"},
	} {
		if _, err := b.MarshalBinary(); !errors.Is(err, ErrMalformed) {
			t.Errorf("begin with %s encoded: %v", name, err)
		}
	}
	for name, mut := range map[string]func(*RestoreReport){
		"negative chunk": func(r *RestoreReport) { r.Results[0].Chunk = -1 },
		"huge chunk":     func(r *RestoreReport) { r.Results[0].Chunk = math.MaxUint32 + 1 },
		"group":          func(r *RestoreReport) { r.Results[1].Group = math.MaxUint16 + 1 },
		"TP rank":        func(r *RestoreReport) { r.Rank.TPRank = -1 },
		"reason":         func(r *RestoreReport) { r.Results[2].Reason = strings.Repeat("x", math.MaxUint16+1) },
		"instance":       func(r *RestoreReport) { r.Rank.Instance = strings.Repeat("i", 256) },
	} {
		r := sampleReport()
		mut(r)
		if _, err := r.MarshalBinary(); !errors.Is(err, ErrMalformed) {
			t.Errorf("report with a bad %s encoded: %v", name, err)
		}
	}
}

// malformedPrefixes: every proper prefix of p, and p with a byte more,
// is refused with ErrMalformed.
func malformedPrefixes(t *testing.T, what string, p []byte, dec func([]byte) error) {
	t.Helper()
	for n := range len(p) {
		if err := dec(p[:n]); !errors.Is(err, ErrMalformed) {
			t.Fatalf("%s truncated to %d of %d bytes: %v", what, n, len(p), err)
		}
	}
	if err := dec(append(append([]byte(nil), p...), 0)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("%s with a trailing byte: %v", what, err)
	}
}

func FuzzBeginUnmarshal(f *testing.F) {
	p, _ := sampleBegin().MarshalBinary()
	fuzzCanonical(f, [][]byte{p, []byte(beginMagic)}, func(p []byte) (*RestoreBeginRequest, error) {
		var r RestoreBeginRequest
		return &r, r.UnmarshalBinary(p)
	})
}

func FuzzReportUnmarshal(f *testing.F) {
	p, _ := sampleReport().MarshalBinary()
	fuzzCanonical(f, [][]byte{p, []byte(reportMagic)}, func(p []byte) (*RestoreReport, error) {
		var r RestoreReport
		return &r, r.UnmarshalBinary(p)
	})
}

// fuzzCanonical fuzzes a binary decoder from seeds: any input either
// fails with an error wrapping ErrMalformed or decodes to a value that
// encodes back to exactly that input (one encoding per value).
func fuzzCanonical[T interface{ MarshalBinary() ([]byte, error) }](f *testing.F, seeds [][]byte, decode func([]byte) (T, error)) {
	for _, s := range seeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		v, err := decode(p)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		q, err := v.MarshalBinary()
		if err != nil || string(q) != string(p) {
			t.Fatalf("decoded value does not re-encode to its input (%v)", err)
		}
	})
}
