package wire

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/kvtier/kvtier/dcp"
)

// Restore plan encodings. restore.begin answers with a RestorePlan as JSON
// by default (~200 B per RetrieveItem: the namespace and the chunk hash of
// every key in hex), or, when the request sets PlanEncoding to
// PlanEncodingBinary, in the compact binary form below (11 B per item),
// which carries a TP8 plan of 60,000 chunks (about 1 M tokens in chunks of
// 16) in 5.3 MB, under the 8 MiB NATS payload limit. An error reply is
// JSON (a wire.Reply with Error set) either way: a binary plan starts with
// the magic "KVP1", a JSON reply with '{'.
//
// The binary plan relies on the shape every plan has: each reader rank
// restores, for every chunk i in [0, Prefix), the same list of objects
// (its expectations: group and shard), in that order; only the checksum
// and the source differ per chunk. The chunk hashes are not repeated:
// they are the request's, by index. Big-endian:
//
//	magic "KVP1"
//	u8 len(restore_id) | restore_id
//	u32 prefix
//	u16 len(reason) | reason
//	namespace (16 B)
//	u16 H | H x holder: (u8 len(instance) | instance | u16 tp_rank)
//	u16 R | R x reader, in Rank.String() order:
//	    u8 len(instance) | instance | u16 tp_rank
//	    u16 E | E x (u16 group | u16 shard)
//	    prefix x E x (u64 sum | u16 holder index | u8 tier), chunk-major
//
// The items of a reader, decoded, are for chunk i and expectation e (in
// that order): RetrieveItem{Chunk: i, Group: e.group, Key: {namespace,
// chunks[i], e.shard, e.group}, Sum, Source: {holders[holder], tier}},
// Blocks empty: exactly the JSON plan's items.
//
// A plan of a restore.begin with StateAtEnd, in which a reader restores
// some objects (a recurrent group's) for the last chunk only, has the
// magic "KVP2" and a flag per expectation, the rest as above:
//
//	u16 E | E x (u16 group | u16 shard | u8 last_only)
//	(prefix-1) x (the expectations with last_only 0) x item, then
//	1 x E x item (the last chunk: every expectation)
//
// The encoder writes "KVP2" only for such a plan, so a reader of KVP1
// alone meets it only after asking for StateAtEnd.
const (
	PlanEncodingJSON   = "json"
	PlanEncodingBinary = "binary"
	planMagic          = "KVP1"
	planMagicLast      = "KVP2" // expectations flagged last-only (StateAtEnd)
	planItemSize       = 8 + 2 + 1
)

// IsBinaryPlan reports whether a restore.begin reply is a binary plan.
func IsBinaryPlan(p []byte) bool {
	return len(p) >= 4 && (string(p[:4]) == planMagic || string(p[:4]) == planMagicLast)
}

// AppendPlanBinary appends the binary encoding of plan, whose keys are all
// in namespace ns. It fails (ErrMalformed) for a plan that does not have
// the regular shape described above.
func AppendPlanBinary(dst []byte, plan *RestorePlan, ns dcp.Namespace) ([]byte, error) {
	bad := func(format string, args ...any) ([]byte, error) {
		return dst, fmt.Errorf("encode restore plan: "+format+": %w", append(args, ErrMalformed)...)
	}
	if len(plan.RestoreID) > 255 || len(plan.Reason) > 65535 || plan.Prefix < 0 || int64(plan.Prefix) > 1<<31 {
		return bad("restore id %d B (limit 255), reason %d B (limit 65535), prefix %d", len(plan.RestoreID), len(plan.Reason), plan.Prefix)
	}
	readers := make([]string, 0, len(plan.Ranks))
	for r := range plan.Ranks {
		readers = append(readers, r)
	}
	slices.Sort(readers)
	if len(readers) > 65535 {
		return bad("%d readers, limit 65535", len(readers))
	}
	// A reader's items mostly share one holder: the last one's index is
	// kept beside the map, so most items look nothing up.
	holders := map[Rank]int{}
	var holderList []Rank
	lastHolder, lastIdx := Rank{}, -1
	holderIdx := func(h Rank) int {
		if lastIdx >= 0 && h == lastHolder {
			return lastIdx
		}
		i, ok := holders[h]
		if !ok {
			i = len(holderList)
			holders[h] = i
			holderList = append(holderList, h)
		}
		lastHolder, lastIdx = h, i
		return i
	}
	items := 0
	for _, r := range readers {
		for i := range plan.Ranks[r] {
			holderIdx(plan.Ranks[r][i].Source.Holder)
		}
		items += len(plan.Ranks[r])
	}
	if len(holderList) > 65535 {
		return bad("%d holders, limit 65535", len(holderList))
	}
	shapes := make([]planShape, len(readers))
	magic := planMagic
	for k, name := range readers {
		sh, err := shapeOf(name, plan.Ranks[name], plan.Prefix)
		if err != nil {
			return bad("%v", err)
		}
		if sh.inner < len(sh.exps) {
			magic = planMagicLast
		}
		shapes[k] = sh
	}
	dst = slices.Grow(dst, 64+len(plan.RestoreID)+len(plan.Reason)+planItemSize*items)
	dst = append(dst, magic...)
	dst = append(dst, byte(len(plan.RestoreID)))
	dst = append(dst, plan.RestoreID...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(plan.Prefix))
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(plan.Reason)))
	dst = append(dst, plan.Reason...)
	dst = append(dst, ns[:]...)
	var err error
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(holderList)))
	for _, h := range holderList {
		if dst, err = appendPlanRank(dst, h); err != nil {
			return dst, err
		}
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(readers)))
	for k, name := range readers {
		r, err := ParseRank(name)
		if err != nil {
			return dst, fmt.Errorf("encode restore plan: reader: %w", err)
		}
		if dst, err = appendPlanRank(dst, r); err != nil {
			return dst, err
		}
		sh := &shapes[k]
		dst = binary.BigEndian.AppendUint16(dst, uint16(len(sh.exps)))
		for _, x := range sh.exps {
			dst = binary.BigEndian.AppendUint16(dst, uint16(x.group))
			dst = binary.BigEndian.AppendUint16(dst, uint16(x.shard))
			if magic == planMagicLast {
				dst = append(dst, b2u8(x.lastOnly))
			}
		}
		for n := range plan.Ranks[name] {
			it := &plan.Ranks[name][n]
			switch {
			case it.Key.NS != ns:
				return bad("reader %s item %d is in namespace %s, want %s", name, n, it.Key.NS, ns)
			case !it.Source.Tier.Valid():
				return bad("reader %s item %d has tier %d", name, n, it.Source.Tier)
			}
			dst = binary.BigEndian.AppendUint64(dst, it.Sum)
			dst = binary.BigEndian.AppendUint16(dst, uint16(holderIdx(it.Source.Holder)))
			dst = append(dst, byte(it.Source.Tier))
		}
	}
	return dst, nil
}

// planExp is one expectation of a reader in a binary plan.
type planExp struct {
	group, shard int
	lastOnly     bool // restored for the plan's last chunk only (StateAtEnd)
}

// planShape is a reader's expectations: exps, of which the first chunks
// restore the inner ones (those not lastOnly), the last chunk all.
type planShape struct {
	exps  []planExp
	inner int
}

// shapeOf checks that a reader's items have the binary plan's shape:
// chunk-major, the last chunk's objects the reader's expectations and
// every earlier chunk's the same subsequence of them (for a plan without
// StateAtEnd, all of them).
func shapeOf(name string, items []RetrieveItem, prefix int) (planShape, error) {
	var sh planShape
	if prefix == 0 {
		return sh, fmt.Errorf("reader %s (%d items) in a plan of prefix 0", name, len(items))
	}
	last := len(items)
	for last > 0 && items[last-1].Chunk == prefix-1 {
		last--
	}
	e := len(items) - last
	if e == 0 || e > 65535 {
		return sh, fmt.Errorf("reader %s has %d objects in its last chunk (%d), want 1 to 65535", name, e, prefix-1)
	}
	sh.exps = make([]planExp, e)
	for j, it := range items[last:] {
		sh.exps[j] = planExp{group: it.Group, shard: int(it.Key.Shard)}
	}
	sh.inner = e
	if prefix > 1 {
		// Chunk 0's objects: which expectations the inner chunks restore.
		n := 0
		for n < last && items[n].Chunk == 0 {
			n++
		}
		if n == 0 || last%n != 0 || last/n != prefix-1 {
			return sh, fmt.Errorf("reader %s has %d items before its last chunk, not %d chunks of %d (chunk 0's) in chunk-major order",
				name, last, prefix-1, n)
		}
		j := 0
		for _, it := range items[:n] {
			for j < e && (sh.exps[j].group != it.Group || sh.exps[j].shard != int(it.Key.Shard)) {
				sh.exps[j].lastOnly = true
				j++
			}
			if j == e {
				return sh, fmt.Errorf("reader %s chunk 0 restores group %d shard %d, which its last chunk does not (or not in that order)",
					name, it.Group, it.Key.Shard)
			}
			j++
		}
		for ; j < e; j++ {
			sh.exps[j].lastOnly = true
		}
		sh.inner = n
	}
	inner := make([]int, 0, sh.inner) // the inner chunks' expectations, by index
	for j, x := range sh.exps {
		if !x.lastOnly {
			inner = append(inner, j)
		}
	}
	for n := range items {
		it := &items[n]
		c, j := prefix-1, n-last
		if n < last {
			c, j = n/len(inner), inner[n%len(inner)]
		}
		x := sh.exps[j]
		switch {
		case it.Chunk != c:
			return sh, fmt.Errorf("reader %s item %d is of chunk %d, want %d (chunk-major order)", name, n, it.Chunk, c)
		case it.Group != x.group || int(it.Key.Shard) != x.shard || int(it.Key.Group) != it.Group:
			return sh, fmt.Errorf("reader %s item %d is group %d shard %d, want group %d shard %d",
				name, n, it.Group, it.Key.Shard, x.group, x.shard)
		}
	}
	return sh, nil
}

func b2u8(b bool) byte {
	if b {
		return 1
	}
	return 0
}

func appendPlanRank(dst []byte, r Rank) ([]byte, error) {
	if len(r.Instance) > 255 || r.TPRank < 0 || r.TPRank > 65535 {
		return dst, fmt.Errorf("encode restore plan: rank %s does not fit (instance <= 255 B, TP rank <= 65535): %w", r, ErrMalformed)
	}
	dst = append(dst, byte(len(r.Instance)))
	dst = append(dst, r.Instance...)
	return binary.BigEndian.AppendUint16(dst, uint16(r.TPRank)), nil
}

// planReader reads a binary plan, remembering the first error.
type planReader struct {
	p   []byte
	err error
}

func (r *planReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("restore plan: "+format+": %w", append(args, ErrMalformed)...)
	}
}

func (r *planReader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.p) {
		r.fail("truncated %s: %d bytes left, want %d", what, len(r.p), n)
		return nil
	}
	b := r.p[:n]
	r.p = r.p[n:]
	return b
}

func (r *planReader) u8(what string) int {
	if b := r.take(1, what); b != nil {
		return int(b[0])
	}
	return 0
}

func (r *planReader) u16(what string) int {
	if b := r.take(2, what); b != nil {
		return int(binary.BigEndian.Uint16(b))
	}
	return 0
}

func (r *planReader) rank(what string) Rank {
	inst := string(r.take(r.u8(what), what))
	return Rank{Instance: inst, TPRank: r.u16(what)}
}

// DecodePlanBinary decodes a binary plan answering a restore.begin for
// chunks (the request's chunk list, which the plan refers to by index).
// Bad input is an error wrapping ErrMalformed, never a panic.
func DecodePlanBinary(p []byte, chunks []dcp.ChunkHash) (*RestorePlan, error) {
	if !IsBinaryPlan(p) {
		return nil, fmt.Errorf("restore plan: missing magic %q: %w", planMagic, ErrMalformed)
	}
	flagged := string(p[:4]) == planMagicLast
	r := &planReader{p: p[4:]}
	plan := &RestorePlan{Ranks: map[string][]RetrieveItem{}}
	plan.RestoreID = string(r.take(r.u8("restore id"), "restore id"))
	if b := r.take(4, "prefix"); b != nil {
		plan.Prefix = int(binary.BigEndian.Uint32(b))
	}
	plan.Reason = string(r.take(r.u16("reason"), "reason"))
	var ns dcp.Namespace
	copy(ns[:], r.take(16, "namespace"))
	if r.err == nil && plan.Prefix > len(chunks) {
		r.fail("prefix %d exceeds the %d chunks requested", plan.Prefix, len(chunks))
	}
	holders := make([]Rank, r.u16("holders"))
	for i := range holders {
		if holders[i] = r.rank("holder"); r.err != nil {
			return nil, r.err
		}
	}
	nr := r.u16("readers")
	for range nr {
		rk := r.rank("reader")
		e := r.u16("objects per chunk")
		if r.err != nil {
			return nil, r.err
		}
		if _, dup := plan.Ranks[rk.String()]; dup {
			return nil, fmt.Errorf("restore plan: reader %s twice: %w", rk, ErrMalformed)
		}
		exps := make([]planExp, e)
		inner := make([]int, 0, e) // the expectations of the chunks before the last
		for j := range exps {
			exps[j] = planExp{group: r.u16("group"), shard: r.u16("shard")}
			if flagged {
				switch f := r.u8("last-only flag"); f {
				case 0:
				case 1:
					exps[j].lastOnly = true
				default:
					r.fail("reader %s expectation %d: last-only flag %d", rk, j, f)
				}
			}
			if !exps[j].lastOnly {
				inner = append(inner, j)
			}
		}
		if r.err == nil && len(inner) == 0 && e > 0 {
			r.fail("reader %s: every one of its %d expectations is last-only", rk, e)
		}
		n := 0 // items
		if plan.Prefix > 0 {
			n = (plan.Prefix-1)*len(inner) + e
		}
		need := uint64(n) * planItemSize
		if r.err == nil && need > uint64(len(r.p)) {
			r.fail("reader %s: %d chunks x %d objects need %d bytes, %d left", rk, plan.Prefix, e, need, len(r.p))
		}
		if r.err != nil {
			return nil, r.err
		}
		items := make([]RetrieveItem, 0, n)
		for i := range plan.Prefix {
			for k := range e {
				x := exps[k]
				if i < plan.Prefix-1 && x.lastOnly {
					continue
				}
				b := r.take(planItemSize, "item")
				h, tier := int(binary.BigEndian.Uint16(b[8:])), Tier(b[10])
				if h >= len(holders) {
					return nil, fmt.Errorf("restore plan: reader %s chunk %d: holder %d of %d: %w", rk, i, h, len(holders), ErrMalformed)
				}
				if !tier.Valid() {
					return nil, fmt.Errorf("restore plan: reader %s chunk %d: tier %d: %w", rk, i, tier, ErrMalformed)
				}
				items = append(items, RetrieveItem{Chunk: i, Group: x.group,
					Key:    dcp.Key{NS: ns, Chunk: chunks[i], Shard: uint16(x.shard), Group: uint16(x.group)},
					Sum:    binary.BigEndian.Uint64(b),
					Source: Source{Holder: holders[h], Tier: tier}})
			}
		}
		plan.Ranks[rk.String()] = items
	}
	if r.err != nil {
		return nil, r.err
	}
	if len(r.p) != 0 {
		return nil, fmt.Errorf("restore plan: %d bytes after the last reader: %w", len(r.p), ErrMalformed)
	}
	return plan, nil
}
