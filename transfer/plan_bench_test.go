package transfer

import (
	"encoding/json"
	"os"
	"testing"

	"go.uber.org/zap"

	"github.com/kvtier/kvtier/cuda"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// planRig is an engine registered with pools large enough for a retrieve
// of chunks chunks into distinct blocks. The pools are allocated, never
// written: the host backend's pools are sparse files, so a 1.3 GB
// geometry costs no memory until touched, and planning touches none.
type planRig struct {
	e   *Engine
	sp  *space
	res *dcp.Resolved
	req RetrieveRequest
}

// tp1Spec is enginesim's tp1 scenario (the spec file it ships).
func tp1Spec(t testing.TB) dcp.Spec {
	t.Helper()
	b, err := os.ReadFile("../enginesim/specs/tp1.json")
	if err != nil {
		t.Fatal(err)
	}
	return specFile(t, b)
}

// specFile decodes an enginesim spec file (the kind of a group spelled
// out; other fields of the file ignored).
func specFile(t testing.TB, b []byte) dcp.Spec {
	t.Helper()
	var f struct {
		dcp.Spec
		Groups []struct {
			dcp.Group
			Kind string `json:"kind"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatalf("spec file: %v", err)
	}
	s := f.Spec
	s.Groups = nil
	for _, g := range f.Groups {
		k, err := dcp.ParseKind(g.Kind)
		if err != nil {
			t.Fatalf("spec file: %v", err)
		}
		g.Group.Kind = k
		s.Groups = append(s.Groups, g.Group)
	}
	return s
}

// newPlanRig registers spec on a fresh engine (TP rank tp) with pools of
// base+chunks*BlocksPerChunk blocks per group and builds a retrieve of
// chunks chunks, chunk c's blocks of group g being base+c*n .. base+(c+1)*n-1.
func newPlanRig(t testing.TB, spec dcp.Spec, tp, chunks int, base int64) *planRig {
	t.Helper()
	res, err := spec.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	dev := openDevice(t, "")
	reg := Registration{Spec: spec, DeviceUUID: dev.Info().UUID}
	for gi, g := range res.Geometry {
		size := g.PoolBytes(base + int64(chunks*res.BlocksPerChunk(gi)))
		for li := range g.Layers {
			m, err := dev.Alloc(size)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = m.Release() })
			h, err := dev.ExportMem(m, 0, size)
			if err != nil {
				t.Fatal(err)
			}
			reg.Pools = append(reg.Pools, wire.PoolRegistration{Group: gi, Layer: li, Handle: h})
		}
	}
	cfg := engineConfig(t, dev, tp, spec.Layout.TP)
	cfg.Logger = zap.NewNop()
	e := newEngine(t, cfg)
	s, err := e.Register(testCtx(t), reg, "")
	if err != nil {
		t.Fatal(err)
	}
	pr := &planRig{e: e, res: res}
	pr.req = RetrieveRequest{RestoreID: "plan", Namespace: res.Namespace, Session: s.ID}
	for c := range chunks {
		for gi := range res.Groups {
			n := res.BlocksPerChunk(gi)
			ids := make([]int64, n)
			for k := range ids {
				ids[k] = base + int64(c*n+k)
			}
			key := dcp.Key{NS: res.Namespace, Chunk: chunkHash(c), Shard: uint16(res.ReadShard(gi, tp)), Group: uint16(gi)}
			pr.req.Items = append(pr.req.Items, wire.RetrieveItem{Chunk: c, Group: gi, Key: key, Blocks: ids})
		}
	}
	e.mu.Lock()
	pr.sp = e.sess.byID[s.ID]
	e.mu.Unlock()
	return pr
}

// plan runs what a retrieve's plan stage runs: the session found and
// held, every item checked and its target spans built, by planRetrieve
// or, checked, by the reference planner alone.
func (pr *planRig) plan(t testing.TB, checked bool) [][]cuda.Span {
	sp, err := pr.e.acquireSpace(pr.req.Namespace, pr.req.Session, pr.req.Caller)
	if err != nil {
		t.Fatal(err)
	}
	defer pr.e.releaseSpace(sp)
	plan := pr.e.planRetrieve
	if checked {
		plan = pr.e.planRetrieveChecked
	}
	spans, err := plan(sp, pr.req)
	if err != nil {
		t.Fatal(err)
	}
	return spans
}

// BenchmarkRetrievePlan measures a retrieve's plan stage for enginesim's
// tp1 scenario and the 8B pages (llama8b-tp1) at 1.3 GB per rank (the H200 bench: 18.1 ms before
// planFast), as planRetrieve does it (fast) and as the reference does
// (checked, the code before issue 25.4):
//
//	go test -run '^$' -bench RetrievePlan -benchmem ./transfer/
func BenchmarkRetrievePlan(b *testing.B) {
	for _, f := range []string{"tp1", "llama8b-tp1"} {
		b.Run(f, func(b *testing.B) {
			raw, err := os.ReadFile("../enginesim/specs/" + f + ".json")
			if err != nil {
				b.Fatal(err)
			}
			benchmarkRetrievePlan(b, specFile(b, raw))
		})
	}
}

func benchmarkRetrievePlan(b *testing.B, spec dcp.Spec) {
	res, err := spec.Resolve()
	if err != nil {
		b.Fatal(err)
	}
	var chunkBytes uint64
	for gi := range res.Groups {
		chunkBytes += res.ObjectSize(gi)
	}
	chunks := int((1.3e9 + float64(chunkBytes) - 1) / float64(chunkBytes))
	pr := newPlanRig(b, spec, 0, chunks, 0)
	spans := 0
	for _, s := range pr.plan(b, false) {
		spans += len(s)
	}
	for _, checked := range []bool{false, true} {
		name := "fast"
		if checked {
			name = "checked"
		}
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				pr.plan(b, checked)
			}
			b.ReportMetric(float64(len(pr.req.Items)), "items")
			b.ReportMetric(float64(spans), "spans")
		})
	}
}
