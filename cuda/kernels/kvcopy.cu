// kvcopy.cu: kvtier's copy kernels. Compiled to PTX by `make ptx` with
// Debian's clang-14, without CUDA headers (everything used is declared here);
// the PTX is committed and JIT-loaded by the driver backend (../driver*.go).
//
// kv_gather copies segments of objects from device pages into a packed buffer
// (pinned host memory mapped into the device, or a device staging buffer);
// kv_scatter copies packed bytes back into the pages. Both compute kvsum64
// (../../checksum/doc.go) of the packed bytes as they pass: every 8-byte word
// of an object at object offset 8i contributes fmix64(w ^ (i*K1 + K2)), the
// terms are reduced per warp and added atomically into the object's uint64
// partial; the host finishes the digest.
//
// The work is destination-driven on the packed side: each thread owns one
// 16-byte-aligned chunk of the packed buffer, so the PCIe side always sees
// aligned 16-byte accesses, coalesced across the warp. The page side, reached
// through a per-thread binary search over the segment's spans, uses the widest
// access that the span's bounds and alignment allow: aligned 8- or 16-byte
// loads funnel-shifted into place inside a span, exact byte accesses at span
// edges; stores into pages use 16, 8, 4, 2 or 1 byte stores by alignment and
// length (contract C3). No byte outside a span or outside a segment's packed
// range is ever written.

#ifndef KV_HOST_EMULATION // a CPU harness that emulates warps defines these itself
#define KV_GLOBAL extern "C" __attribute__((global))
#define KV_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
#define KV_GLOBAL_AS __attribute__((address_space(1)))
#endif

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#ifndef KV_HOST_EMULATION
typedef u64 u64x2 __attribute__((ext_vector_type(2)));
#else
struct u64x2 {
	u64 x, y;
};
#endif

// Global-memory views of an address (mapped pinned host memory included).
typedef KV_GLOBAL_AS u64x2 g128;
typedef KV_GLOBAL_AS u64 g64;
typedef KV_GLOBAL_AS u32 g32;
typedef KV_GLOBAL_AS u16 g16;
typedef KV_GLOBAL_AS u8 g8;

// Seg and Span are laid out exactly as driver_job.go writes them.
struct Seg {
	u64 packed;    // device address of the segment's first packed byte
	u64 objOff;    // offset of the segment in its object, a multiple of 16
	u64 len;       // bytes in the segment, > 0
	u64 chunkBase; // global index of the segment's first 16-byte chunk
	u32 spanBase;  // first span of the segment's object in the span table
	u32 nspans;    // spans of the object from spanBase on
	u32 sum;       // index of the object's partial sum
	u32 pad;
};

struct Span {
	u64 ptr;    // device address of the span's first byte
	u64 objOff; // offset of the span's first byte in its object
	u64 len;    // bytes, > 0
};

// V is 16 bytes, little-endian: byte k is byte k%8 of lo (k < 8) or hi.
struct V {
	u64 lo, hi;
};

enum {
	NT = 256, // threads per block
	ITER = 4, // chunks per thread per tile
	TILE = NT * ITER,
	FLAG_SUM = 1,
	FLAG_NOSTORE = 2, // gather only: read and hash the spans, write nothing (the read-back check after a scatter)
	NONE = 0xffffffffu,
};

#define K1 0x9E3779B97F4A7C15ull
#define K2 0xC2B2AE3D27D4EB4Full

KV_DEVICE u64 fmix64(u64 x) {
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

KV_DEVICE u64 term(u64 i, u64 w) { return fmix64(w ^ (i * K1 + K2)); }

KV_DEVICE u32 tid() { return __nvvm_read_ptx_sreg_tid_x(); }
KV_DEVICE u32 lane() { return __nvvm_read_ptx_sreg_laneid(); }

KV_DEVICE u32 shfl_down32(u32 v, u32 d) { return __nvvm_shfl_sync_down_i32(0xffffffffu, v, d, 31); }
KV_DEVICE u32 shfl_up32(u32 v, u32 d) { return __nvvm_shfl_sync_up_i32(0xffffffffu, v, d, 0); }
KV_DEVICE u64 shfl_down64(u64 v, u32 d) {
	return ((u64)shfl_down32((u32)(v >> 32), d) << 32) | shfl_down32((u32)v, d);
}

// low keeps the low n bytes (0..8 and more) of v.
KV_DEVICE u64 low(u64 v, u32 n) { return n >= 8 ? v : (v & ((1ull << (8 * n)) - 1)); }

// shl and shr shift a V by b bytes, 0..16.
KV_DEVICE V shl(V v, u32 b) {
	if (b == 0) return v;
	if (b >= 16) return V{0, 0};
	if (b >= 8) return V{0, v.lo << (8 * (b - 8))};
	return V{v.lo << (8 * b), (v.hi << (8 * b)) | (v.lo >> (64 - 8 * b))};
}

KV_DEVICE V shr(V v, u32 b) {
	if (b == 0) return v;
	if (b >= 16) return V{0, 0};
	if (b >= 8) return V{v.hi >> (8 * (b - 8)), 0};
	return V{(v.lo >> (8 * b)) | (v.hi << (64 - 8 * b)), v.hi >> (8 * b)};
}

// keep zeroes every byte of v outside positions [from, to), to <= 16.
KV_DEVICE V keep(V v, u32 from, u32 to) {
	if (to < 8) {
		v.lo = low(v.lo, to);
		v.hi = 0;
	} else {
		v.hi = low(v.hi, to - 8);
	}
	if (from >= 8) {
		v.lo = 0;
		v.hi &= ~low(~0ull, from - 8);
	} else {
		v.lo &= ~low(~0ull, from);
	}
	return v;
}

// load reads n bytes (1..16) at p, which lies in the span [sp, se), into
// positions [0, n) of the result; the other bytes are zero. Where the aligned
// words covering [p, p+n) lie inside the span it reads them whole (one 16-byte
// load when p is 16-aligned, else 8-byte loads) and funnel-shifts; at the
// span's edges it reads exact bytes.
KV_DEVICE V load(u64 p, u32 n, u64 sp, u64 se) {
	u32 r = (u32)(p & 7);
	u64 q = p - r;
	u32 nw = (r + n + 7) >> 3; // aligned words covering [p, p+n): 1..3
	if (q >= sp && q + 8 * (u64)nw <= se) {
		if (n == 16 && (p & 15) == 0) {
			u64x2 w = *(const g128 *)p;
			return V{w.x, w.y};
		}
		u64 a0 = *(const g64 *)q;
		u64 a1 = nw > 1 ? *(const g64 *)(q + 8) : 0;
		u64 a2 = nw > 2 ? *(const g64 *)(q + 16) : 0;
		V v;
		if (r != 0) {
			v.lo = (a0 >> (8 * r)) | (a1 << (64 - 8 * r));
			v.hi = (a1 >> (8 * r)) | (a2 << (64 - 8 * r));
		} else {
			v.lo = a0;
			v.hi = a1;
		}
		return keep(v, 0, n);
	}
	V v{0, 0};
	for (u32 k = 0; k < n; k++) {
		u64 b = *(const g8 *)(p + k);
		if (k < 8) v.lo |= b << (8 * k); else v.hi |= b << (8 * (k - 8));
	}
	return v;
}

// store writes the low n bytes (0..16) of v at p with the widest stores that
// p's alignment and n allow.
KV_DEVICE void store(u64 p, u32 n, V v) {
	if (n == 16 && (p & 15) == 0) {
		u64x2 w;
		w.x = v.lo;
		w.y = v.hi;
		*(g128 *)p = w;
		return;
	}
	while (n > 0) {
		u32 k;
		if ((p & 7) == 0 && n >= 8) {
			*(g64 *)p = v.lo;
			k = 8;
		} else if ((p & 3) == 0 && n >= 4) {
			*(g32 *)p = (u32)v.lo;
			k = 4;
		} else if ((p & 1) == 0 && n >= 2) {
			*(g16 *)p = (u16)v.lo;
			k = 2;
		} else {
			*(g8 *)p = (u8)v.lo;
			k = 1;
		}
		v = shr(v, k);
		p += k;
		n -= k;
	}
}

// findSpan returns the index of the span holding object offset x: the last
// of spans[base, base+n) whose objOff <= x.
KV_DEVICE u32 findSpan(const Span *spans, u32 base, u32 n, u64 x) {
	u32 lo = base, hi = base + n;
	while (hi - lo > 1) {
		u32 mid = lo + (hi - lo) / 2;
		if (spans[mid].objOff <= x) lo = mid; else hi = mid;
	}
	return lo;
}

// findSeg returns the last segment whose chunkBase <= g.
KV_DEVICE u32 findSeg(const Seg *segs, u32 n, u64 g) {
	u32 lo = 0, hi = n;
	while (hi - lo > 1) {
		u32 mid = lo + (hi - lo) / 2;
		if (segs[mid].chunkBase <= g) lo = mid; else hi = mid;
	}
	return lo;
}

// gatherBytes assembles segment bytes [from, to) (to-from <= 16) from the
// spans, at positions from-base of the result; other bytes are zero.
KV_DEVICE V gatherBytes(const Span *spans, const Seg &s, i64 base, u64 from, u64 to) {
	V v{0, 0};
	if (from >= to) return v;
	u64 x = s.objOff + from;
	u32 si = findSpan(spans, s.spanBase, s.nspans, x);
	while (from < to) {
		Span sp = spans[si];
		u64 in = x - sp.objOff;
		u64 n = sp.len - in;
		if (n > to - from) n = to - from;
		V piece = shl(load(sp.ptr + in, (u32)n, sp.ptr, sp.ptr + sp.len), (u32)((i64)from - base));
		v.lo |= piece.lo;
		v.hi |= piece.hi;
		from += n;
		x += n;
		si++;
	}
	return v;
}

// scatterBytes writes segment bytes [from, to), held at positions from-base
// of v, into the spans.
KV_DEVICE void scatterBytes(const Span *spans, const Seg &s, i64 base, u64 from, u64 to, V v) {
	if (from >= to) return;
	u64 x = s.objOff + from;
	u32 si = findSpan(spans, s.spanBase, s.nspans, x);
	while (from < to) {
		Span sp = spans[si];
		u64 in = x - sp.objOff;
		u64 n = sp.len - in;
		if (n > to - from) n = to - from;
		store(sp.ptr + in, (u32)n, shr(v, (u32)((i64)from - base)));
		from += n;
		x += n;
		si++;
	}
}

// copy is the body of both kernels. The grid walks tiles of TILE chunks;
// thread t of a tile handles chunks t, t+NT, ... so that each warp-wide
// access covers 512 contiguous bytes of the packed buffer.
template <bool SCATTER>
KV_DEVICE void copy(const Seg *segs, u32 nsegs, const Span *spans, u64 nchunks, u64 *partials, u32 flags) {
	const bool sum = (flags & FLAG_SUM) != 0;
	const u64 ntiles = (nchunks + TILE - 1) / TILE;
	u32 accKey = NONE; // lane 0's running partial: object and value
	u64 acc = 0;
	u32 cur = 0; // cached segment
	u64 curBase = 1, curEnd = 0;

	for (u64 tile = __nvvm_read_ptx_sreg_ctaid_x(); tile < ntiles; tile += __nvvm_read_ptx_sreg_nctaid_x()) {
		u64 g[ITER];
		u32 si[ITER];
		V v[ITER];
#pragma unroll
		for (int j = 0; j < ITER; j++) {
			g[j] = tile * TILE + (u64)j * NT + tid();
			si[j] = NONE;
			v[j] = V{0, 0};
			if (g[j] < nchunks) {
				if (g[j] < curBase || g[j] >= curEnd) {
					cur = findSeg(segs, nsegs, g[j]);
					curBase = segs[cur].chunkBase;
					curEnd = cur + 1 < nsegs ? segs[cur + 1].chunkBase : nchunks;
				}
				si[j] = cur;
				if (SCATTER) {
					// Packed side: one aligned 16-byte load per chunk, all
					// issued before any is used. Bytes outside the segment are
					// masked below; an aligned chunk never leaves its pages.
					u64 c = (segs[cur].packed & ~15ull) + 16 * (g[j] - curBase);
					u64x2 w = *(const g128 *)c;
					v[j] = V{w.x, w.y};
				}
			}
		}
#pragma unroll
		for (int j = 0; j < ITER; j++) {
			const bool valid = si[j] != NONE;
			Seg s{};
			i64 a = 0;
			u64 c = 0;
			if (valid) {
				s = segs[si[j]];
				c = (s.packed & ~15ull) + 16 * (g[j] - s.chunkBase);
				a = (i64)(c - s.packed); // segment offset of the chunk's first byte
				u64 from = a < 0 ? 0 : (u64)a;
				u64 to = a + 16 < (i64)s.len ? (u64)(a + 16) : s.len;
				u32 head = (u32)((i64)from - a);
				if (SCATTER) {
					v[j] = keep(v[j], head, (u32)((i64)to - a));
					scatterBytes(spans, s, a, from, to, v[j]);
				} else {
					v[j] = gatherBytes(spans, s, a, from, to);
					if (!(flags & FLAG_NOSTORE)) store(c + head, (u32)(to - from), shr(v[j], head));
				}
			}
			if (!sum) continue; // uniform across the grid

			// Checksum words start at packed addresses congruent to the
			// segment's start mod 8: chunk positions s8 and s8+8. When s8 is
			// not 0 the second word runs into the next chunk; its bytes come
			// from lane+1 when that lane holds the next chunk of the segment.
			u64 nextLo = shfl_down64(v[j].lo, 1);
			u32 nextSeg = shfl_down32(si[j], 1);
			u64 t = 0;
			if (valid) {
				u32 s8 = (u32)(s.packed & 7);
				i64 off0 = a + s8; // segment offset of the first word: 0 or -8 in the first chunk
				if (s8 != 0 && a + 16 < (i64)s.len) {
					if (lane() == 31 || nextSeg != si[j]) {
						u64 nto = a + 24 < (i64)s.len ? (u64)(a + 24) : s.len;
						if (SCATTER) {
							nextLo = low(*(const g64 *)(c + 16), (u32)(nto - (u64)(a + 16)));
						} else {
							nextLo = gatherBytes(spans, s, a + 16, (u64)(a + 16), nto).lo;
						}
					}
				} else {
					nextLo = 0;
				}
				u64 w0 = v[j].lo, w1 = v[j].hi;
				if (s8 != 0) {
					w0 = (v[j].lo >> (8 * s8)) | (v[j].hi << (64 - 8 * s8));
					w1 = (v[j].hi >> (8 * s8)) | (nextLo << (64 - 8 * s8));
				}
				if (off0 >= 0 && off0 < (i64)s.len) t += term((s.objOff + (u64)off0) >> 3, w0);
				if (off0 + 8 < (i64)s.len) t += term((s.objOff + (u64)(off0 + 8)) >> 3, w1);
			}
			// Segmented reduction over the warp: lanes of one object are
			// contiguous; afterwards each run's first lane holds its total.
			u32 key = valid ? s.sum : NONE;
#pragma unroll
			for (u32 d = 1; d < 32; d <<= 1) {
				u64 ot = shfl_down64(t, d);
				u32 ok = shfl_down32(key, d);
				if (lane() + d < 32 && ok == key) t += ot;
			}
			u32 prev = shfl_up32(key, 1);
			if (key != NONE && (lane() == 0 || prev != key)) {
				if (lane() == 0) {
					if (accKey != key) {
						if (accKey != NONE) __nvvm_atom_add_gen_ll((long long *)&partials[accKey], (long long)acc);
						accKey = key;
						acc = 0;
					}
					acc += t;
				} else {
					__nvvm_atom_add_gen_ll((long long *)&partials[key], (long long)t);
				}
			}
		}
	}
	if (accKey != NONE) __nvvm_atom_add_gen_ll((long long *)&partials[accKey], (long long)acc);
}

KV_GLOBAL void kv_gather(const Seg *segs, u32 nsegs, const Span *spans, u64 nchunks, u64 *partials, u32 flags) {
	copy<false>(segs, nsegs, spans, nchunks, partials, flags);
}

KV_GLOBAL void kv_scatter(const Seg *segs, u32 nsegs, const Span *spans, u64 nchunks, u64 *partials, u32 flags) {
	copy<true>(segs, nsegs, spans, nchunks, partials, flags);
}

// kv_checksum computes the partial sums of the segments' spans and writes
// nothing: the verification of bytes the copy engine moved (../dma_plan.go),
// run on the pages in device memory (a scatter's destination once placed, a
// gather's source), which it reads at HBM speed instead of holding
// multiprocessors for the whole PCIe transfer. The packed side is virtual
// (the driver lays segments out at 16-byte-aligned addresses that are never
// dereferenced): it only says which object words each thread hashes. The
// partials are the ones kv_gather computes over the same spans.
KV_GLOBAL void kv_checksum(const Seg *segs, u32 nsegs, const Span *spans, u64 nchunks, u64 *partials, u32 flags) {
	copy<false>(segs, nsegs, spans, nchunks, partials, (flags & FLAG_SUM) | FLAG_NOSTORE);
}

// kv_sum_units is kv_checksum for transfers whose every span starts at an
// 8-byte-aligned device address and object offset and ends on a word (or at
// its object's end): its table is of units, pieces of one span each, laid
// out as Seg with packed the unit's first device address, objOff its object
// offset (a multiple of 8), len its bytes (a multiple of 8 unless the unit
// ends its object, whose last word is zero-padded) and sum its object.
// A warp hashes a unit: 16-byte loads where the unit is 16-aligned, four in
// flight per lane, every lane's terms added up and reduced over the warp
// once per unit, one atomic add per unit; no search, no shuffle per word.
// It reads HBM near its speed, so the time it holds the GPU away from
// another context's kernels (the engine's forward) is a fraction of
// kv_checksum's. spans and nchunks are unused (the launch is the copy
// kernels' one).
KV_GLOBAL void kv_sum_units(const Seg *units, u32 nunits, const Span *spans, u64 nchunks, u64 *partials, u32 flags) {
	(void)spans;
	(void)nchunks;
	const u32 wpb = NT / 32;
	const u32 nw = __nvvm_read_ptx_sreg_nctaid_x() * wpb;
	const u32 ln = lane();
	for (u32 u = __nvvm_read_ptx_sreg_ctaid_x() * wpb + tid() / 32; u < nunits; u += nw) {
		const Seg s = units[u];
		const u64 i0 = s.objOff >> 3;
		const u64 words = s.len >> 3;
		u64 t = 0;
		u64 k = 0; // words below k are hashed by the vector loop
		if ((s.packed & 15) == 0) {
			const g128 *q = (const g128 *)s.packed;
			const u64 pairs = words >> 1;
			u64 j = ln;
			for (; j + 96 < pairs; j += 128) {
				u64x2 a = q[j], b = q[j + 32], c = q[j + 64], d = q[j + 96];
				const u64 w = i0 + 2 * j;
				t += term(w, a.x) + term(w + 1, a.y) + term(w + 64, b.x) + term(w + 65, b.y);
				t += term(w + 128, c.x) + term(w + 129, c.y) + term(w + 192, d.x) + term(w + 193, d.y);
			}
			for (; j < pairs; j += 32) {
				u64x2 a = q[j];
				t += term(i0 + 2 * j, a.x) + term(i0 + 2 * j + 1, a.y);
			}
			k = 2 * pairs;
		}
		const g64 *p = (const g64 *)s.packed;
		for (u64 j = k + ln; j < words; j += 32) t += term(i0 + j, p[j]);
		const u32 rem = (u32)(s.len & 7);
		if (rem != 0 && ln == 0) { // the object's zero-padded last word, read byte by byte
			const g8 *b = (const g8 *)(s.packed + 8 * words);
			u64 w = 0;
			for (u32 x = 0; x < rem; x++) w |= (u64)b[x] << (8 * x);
			t += term(i0 + words, w);
		}
#pragma unroll
		for (u32 d = 16; d > 0; d >>= 1) t += shfl_down64(t, d);
		if (ln == 0 && (flags & FLAG_SUM)) __nvvm_atom_add_gen_ll((long long *)&partials[s.sum], (long long)t);
	}
}

// kv_move copies n bytes from src to dst, device addresses both (mapped
// pinned host memory included), 16 bytes a thread where both are
// 16-aligned: with DMATuning.SMControl the driver moves a transfer's tables
// to the device and its partial sums back with it on a multiprocessor,
// instead of copy-engine copies, which queue behind the bulk copies of
// another transfer going the same way (a store's tables behind a restore's
// pages, a restore's sums behind a store's).
KV_GLOBAL void kv_move(u64 dst, u64 src, u64 n) {
	const u64 nt = (u64)__nvvm_read_ptx_sreg_nctaid_x() * NT;
	const u64 t0 = (u64)__nvvm_read_ptx_sreg_ctaid_x() * NT + tid();
	u64 k = 0;
	if (((dst | src) & 15) == 0) {
		const u64 n16 = n >> 4;
		for (u64 i = t0; i < n16; i += nt) ((g128 *)dst)[i] = ((const g128 *)src)[i];
		k = n16 << 4;
	}
	for (u64 i = k + t0; i < n; i += nt) ((g8 *)dst)[i] = ((const g8 *)src)[i];
}

#ifndef KV_HOST_EMULATION
// kv_delay spins one thread for at least ns nanoseconds of the global timer:
// device work standing in for an engine still writing its pages.
KV_GLOBAL void kv_delay(u64 ns) {
	u64 t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	do {
		asm volatile("nanosleep.u32 1000;");
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	} while (t - t0 < ns);
}
#endif
