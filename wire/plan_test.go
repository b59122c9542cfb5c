package wire

import (
	"bytes"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/dcp"
)

// samplePlan is a plan of 2 chunks for 2 readers: reader 0 restores two
// objects per chunk (groups 0 and 1), reader 1 one.
func samplePlan() (*RestorePlan, dcp.Namespace, []dcp.ChunkHash) {
	var ns dcp.Namespace
	ns[0], ns[15] = 0x11, 0x22
	chunks := []dcp.ChunkHash{{0xc0}, {0xc1}, {0xc2}}
	h0, h1 := Rank{Instance: "e", TPRank: 0}, Rank{Instance: "e", TPRank: 1}
	item := func(chunk, group, shard int, sum uint64, h Rank, tier Tier) RetrieveItem {
		return RetrieveItem{Chunk: chunk, Group: group, Sum: sum, Source: Source{Holder: h, Tier: tier},
			Key: dcp.Key{NS: ns, Chunk: chunks[chunk], Shard: uint16(shard), Group: uint16(group)}}
	}
	return &RestorePlan{RestoreID: "b-1", Prefix: 2, Ranks: map[string][]RetrieveItem{
		"e/0": {item(0, 0, 0, 1, h0, L1), item(0, 1, 0, 2, h0, L2), item(1, 0, 0, 3, h1, L2), item(1, 1, 0, 4, h0, L1)},
		"e/1": {item(0, 0, 1, 5, h1, L1), item(1, 0, 1, 6, h1, L1)},
	}}, ns, chunks
}

// The binary plan is pinned byte for byte (the Python connector decodes
// it) and decodes to exactly the JSON plan's items.
func TestPlanBinaryGolden(t *testing.T) {
	plan, ns, chunks := samplePlan()
	p, err := AppendPlanBinary(nil, plan, ns)
	if err != nil {
		t.Fatal(err)
	}
	const want = "4b565031" + "03" + "622d31" + "00000002" + "0000" + "11000000000000000000000000000022" +
		"0002" + "01" + "65" + "0000" + "01" + "65" + "0001" + // holders e/0, e/1
		"0002" + // readers
		"01" + "65" + "0000" + "0002" + "0000" + "0000" + "0001" + "0000" + // e/0: groups 0, 1 of shard 0
		"0000000000000001" + "0000" + "01" + "0000000000000002" + "0000" + "02" +
		"0000000000000003" + "0001" + "02" + "0000000000000004" + "0000" + "01" +
		"01" + "65" + "0001" + "0001" + "0000" + "0001" + // e/1: group 0 of shard 1
		"0000000000000005" + "0001" + "01" + "0000000000000006" + "0001" + "01"
	if got := hex.EncodeToString(p); got != want {
		t.Fatalf("encoding\n got %s\nwant %s", got, want)
	}
	back, err := DecodePlanBinary(p, chunks)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, plan) {
		t.Fatalf("decoded %+v\nwant    %+v", back, plan)
	}
	if !IsBinaryPlan(p) || IsBinaryPlan([]byte(`{"ok":{}}`)) {
		t.Fatal("IsBinaryPlan does not tell binary from JSON")
	}
	empty := &RestorePlan{RestoreID: "x", Reason: "rank e/1 not alive", Ranks: map[string][]RetrieveItem{}}
	p, err = AppendPlanBinary(nil, empty, ns)
	if err != nil {
		t.Fatal(err)
	}
	if back, err := DecodePlanBinary(p, nil); err != nil || !reflect.DeepEqual(back, empty) {
		t.Fatalf("empty plan round trip = %+v, %v", back, err)
	}
}

// A TP8 plan of 60,000 chunks (about 1 M tokens in chunks of 16) fits the
// 8 MiB NATS payload in the binary form.
func TestPlanBinaryTP8MillionTokens(t *testing.T) {
	const chunks, tp = 60_000, 8
	var ns dcp.Namespace
	plan := &RestorePlan{RestoreID: "big", Prefix: chunks, Ranks: map[string][]RetrieveItem{}}
	for r := range tp {
		h := Rank{Instance: "engine-0", TPRank: r}
		items := make([]RetrieveItem, chunks)
		for i := range items {
			items[i] = RetrieveItem{Chunk: i, Key: dcp.Key{NS: ns, Shard: uint16(r)}, Sum: uint64(i), Source: Source{Holder: h, Tier: L2}}
		}
		plan.Ranks[h.String()] = items
	}
	p, err := AppendPlanBinary(nil, plan, ns)
	if err != nil {
		t.Fatal(err)
	}
	if len(p) > 8<<20 {
		t.Fatalf("binary TP8 plan of %d chunks is %d B, over 8 MiB", chunks, len(p))
	}
}

func TestPlanBinaryRejects(t *testing.T) {
	plan, ns, chunks := samplePlan()
	good, _ := AppendPlanBinary(nil, plan, ns)
	mut := func(f func(p []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, c := range map[string]struct {
		p      []byte
		chunks []dcp.ChunkHash
	}{
		"empty":          {nil, chunks},
		"magic":          {mut(func(p []byte) []byte { p[0] = 'X'; return p }), chunks},
		"truncated":      {good[:len(good)-1], chunks},
		"trailing":       {append(append([]byte(nil), good...), 0), chunks},
		"prefix > asked": {good, chunks[:1]},
		"holder index":   {mut(func(p []byte) []byte { p[len(p)-3] = 9; return p }), chunks},
		"tier":           {mut(func(p []byte) []byte { p[len(p)-1] = 7; return p }), chunks},
		"huge prefix":    {mut(func(p []byte) []byte { p[8], p[9] = 0x7f, 0xff; return p }), make([]dcp.ChunkHash, 1<<20)},
	} {
		if _, err := DecodePlanBinary(c.p, c.chunks); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
	irregular, _, _ := samplePlan()
	irregular.Ranks["e/1"][1].Key.Shard = 3
	if _, err := AppendPlanBinary(nil, irregular, ns); !errors.Is(err, ErrMalformed) {
		t.Errorf("irregular plan encoded: %v", err)
	}
	misordered, _, _ := samplePlan()
	misordered.Ranks["e/1"][0].Chunk, misordered.Ranks["e/1"][1].Chunk = 1, 0
	if _, err := AppendPlanBinary(nil, misordered, ns); !errors.Is(err, ErrMalformed) {
		t.Errorf("misordered plan encoded: %v", err)
	}
}

// A plan of a restore.begin with StateAtEnd (a recurrent group restored
// for the last chunk only) goes as KVP2 and comes back item for item;
// shapes it cannot carry are refused, never encoded wrong.
func TestPlanBinaryLastOnly(t *testing.T) {
	var ns dcp.Namespace
	chunks := []dcp.ChunkHash{{0xc0}, {0xc1}, {0xc2}}
	h := Rank{Instance: "e", TPRank: 0}
	item := func(chunk, group, shard int) RetrieveItem {
		return RetrieveItem{Chunk: chunk, Group: group, Sum: uint64(100*chunk + 10*group + shard + 1), Source: Source{Holder: h, Tier: L2},
			Key: dcp.Key{NS: ns, Chunk: chunks[chunk], Shard: uint16(shard), Group: uint16(group)}}
	}
	mk := func() *RestorePlan {
		return &RestorePlan{RestoreID: "s", Prefix: 3, Ranks: map[string][]RetrieveItem{
			// groups 0 and 2 recurrent: their states for chunk 2 only
			"e/0": {item(0, 1, 0), item(1, 1, 0), item(2, 0, 0), item(2, 1, 0), item(2, 2, 0)},
			"e/1": {item(0, 1, 1), item(1, 1, 1), item(2, 1, 1)}, // a reader without states: flags 0
		}}
	}
	plan := mk()
	p, err := AppendPlanBinary(nil, plan, ns)
	if err != nil {
		t.Fatal(err)
	}
	if string(p[:4]) != planMagicLast || !IsBinaryPlan(p) {
		t.Fatalf("magic %q, want %q", p[:4], planMagicLast)
	}
	back, err := DecodePlanBinary(p, chunks)
	if err != nil || !reflect.DeepEqual(back, plan) {
		t.Fatalf("round trip = %+v, %v\nwant %+v", back, err, plan)
	}
	one := &RestorePlan{RestoreID: "s", Prefix: 1, Ranks: map[string][]RetrieveItem{"e/0": {item(0, 0, 0), item(0, 1, 0)}}}
	if p, err := AppendPlanBinary(nil, one, ns); err != nil || string(p[:4]) != planMagic {
		t.Fatalf("a plan of one chunk: %q, %v; want KVP1 (nothing is last-only)", p[:min(4, len(p))], err)
	}
	for name, f := range map[string]func(p *RestorePlan){
		"inner chunk differs from chunk 0": func(p *RestorePlan) { p.Ranks["e/0"][1] = item(1, 2, 0) },
		"chunk 0 has what the last lacks":  func(p *RestorePlan) { p.Ranks["e/1"][0] = item(0, 3, 1) },
		"last chunk short":                 func(p *RestorePlan) { p.Ranks["e/1"] = p.Ranks["e/1"][:2] },
		"an inner chunk missing":           func(p *RestorePlan) { p.Ranks["e/1"] = append(p.Ranks["e/1"][:1], p.Ranks["e/1"][2]) },
	} {
		bad := mk()
		f(bad)
		if _, err := AppendPlanBinary(nil, bad, ns); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: encoded (%v)", name, err)
		}
	}
	// The flags: a value other than 0 or 1, and a reader all of whose
	// expectations are last-only, are malformed. e/0's expectations follow
	// its rank (u8 1, "e", u16 0) and their count (u16 3).
	off := bytes.Index(p, []byte{1, 'e', 0, 0, 0, 3}) + 6
	if p[off+4] != 1 || p[off+9] != 0 {
		t.Fatalf("flags at %d: %x, want 01 then 00", off, p[off:off+15])
	}
	for name, mut := range map[string]func(b []byte){
		"flag 2":        func(b []byte) { b[off+4] = 2 },
		"all last-only": func(b []byte) { b[off+9] = 1 }, // groups 0 and 2 are, and now 1
	} {
		b := append([]byte(nil), p...)
		mut(b)
		if _, err := DecodePlanBinary(b, chunks); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: decoded (%v)", name, err)
		}
	}
}

func FuzzPlanDecode(f *testing.F) {
	plan, ns, chunks := samplePlan()
	good, _ := AppendPlanBinary(nil, plan, ns)
	f.Add(good)
	f.Add([]byte(planMagic))
	last, err := os.ReadFile(filepath.Join(compactDir, "restore_plan_last.bin")) // KVP2, 2 chunks
	if err != nil {
		f.Fatal(err)
	}
	f.Add(last)
	f.Fuzz(func(t *testing.T, p []byte) {
		back, err := DecodePlanBinary(p, chunks)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		q, err := AppendPlanBinary(nil, back, ns)
		if err != nil {
			return // e.g. a reader name that is not a rank; decoding it was still safe
		}
		again, err := DecodePlanBinary(q, chunks)
		if err != nil || !reflect.DeepEqual(again, back) && back.Prefix > 0 {
			t.Fatalf("decoded plan does not survive a re-encoding: %v", err)
		}
	})
}
