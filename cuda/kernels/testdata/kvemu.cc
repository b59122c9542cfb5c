// kvemu.cc runs kvcopy.cu's checksum kernels on the CPU for package cuda's
// tests (kernelemu_test.go), which have no GPU: every lane of a warp is a
// thread, the warp's shuffles meet at a barrier, a block's warps and the
// grid's blocks run one after the other (the kernels never synchronize
// beyond a warp), the atomics are the host's. The kernel source is
// compiled as it is, with KV_HOST_EMULATION and the intrinsics below.
//
//	kvemu KERNEL BLOCKS TABLES    KERNEL: checksum | units
//
// TABLES is what the test wrote: a header of six little-endian uint64
// (segments, spans, chunks, objects, image bytes, flags), the segments as
// struct Seg, the spans as struct Span, then the image whose offsets the
// tables' device addresses are (relocated here to the image in memory:
// a span's ptr for kv_checksum, a unit's packed for kv_sum_units). It
// prints every object's partial sum, one hexadecimal number a line.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define KV_HOST_EMULATION 1
#define KV_GLOBAL extern "C"
#define KV_DEVICE static inline
#define KV_GLOBAL_AS

struct Warp {
	std::barrier<> bar{32};
	unsigned xchg[32];
};

struct LaneState {
	unsigned tid, ctaid, nctaid;
	Warp *warp;
};
static thread_local LaneState lane_;

static unsigned __nvvm_read_ptx_sreg_tid_x() { return lane_.tid; }
static unsigned __nvvm_read_ptx_sreg_laneid() { return lane_.tid % 32; }
static unsigned __nvvm_read_ptx_sreg_ctaid_x() { return lane_.ctaid; }
static unsigned __nvvm_read_ptx_sreg_nctaid_x() { return lane_.nctaid; }

// exchange publishes v and returns lane src's value (v itself when src is
// outside the warp, as shfl.sync's clamp does).
static unsigned exchange(unsigned v, int src) {
	Warp *w = lane_.warp;
	unsigned me = lane_.tid % 32;
	w->xchg[me] = v;
	w->bar.arrive_and_wait();
	unsigned r = (src >= 0 && src < 32) ? w->xchg[src] : v;
	w->bar.arrive_and_wait();
	return r;
}
static unsigned __nvvm_shfl_sync_down_i32(unsigned, unsigned v, unsigned d, unsigned) {
	return exchange(v, (int)(lane_.tid % 32 + d));
}
static unsigned __nvvm_shfl_sync_up_i32(unsigned, unsigned v, unsigned d, unsigned) {
	return exchange(v, (int)(lane_.tid % 32) - (int)d);
}
static long long __nvvm_atom_add_gen_ll(long long *p, long long v) {
	return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

#include "../kvcopy.cu"

typedef void Kernel(const Seg *, u32, const Span *, u64, u64 *, u32);

int main(int argc, char **argv) {
	if (argc != 4) {
		fprintf(stderr, "usage: kvemu checksum|units BLOCKS TABLES\n");
		return 2;
	}
	Kernel *k = strcmp(argv[1], "units") == 0 ? kv_sum_units : kv_checksum;
	unsigned blocks = (unsigned)atoi(argv[2]);
	FILE *f = fopen(argv[3], "rb");
	u64 h[6];
	if (!f || fread(h, 8, 6, f) != 6) {
		fprintf(stderr, "kvemu: cannot read %s\n", argv[3]);
		return 2;
	}
	std::vector<Seg> segs(h[0]);
	std::vector<Span> spans(h[1]);
	std::vector<u64> partials(h[3]);
	std::vector<unsigned char> img(h[4] + 16);
	unsigned char *base = img.data() + (16 - (uintptr_t)img.data() % 16) % 16; // 16-aligned, as device memory is
	if (fread(segs.data(), sizeof(Seg), segs.size(), f) != segs.size() ||
	    fread(spans.data(), sizeof(Span), spans.size(), f) != spans.size() || fread(base, 1, h[4], f) != h[4]) {
		fprintf(stderr, "kvemu: %s is short\n", argv[3]);
		return 2;
	}
	fclose(f);
	if (k == kv_sum_units) {
		for (Seg &s : segs) s.packed += (u64)(uintptr_t)base;
	} else {
		for (Span &s : spans) s.ptr += (u64)(uintptr_t)base;
	}
	for (unsigned b = 0; b < blocks; b++) {
		for (unsigned w = 0; w < NT / 32; w++) {
			Warp warp;
			std::vector<std::thread> lanes;
			for (unsigned l = 0; l < 32; l++) {
				lanes.emplace_back([&, l] {
					lane_ = LaneState{w * 32 + l, b, blocks, &warp};
					k(segs.data(), (u32)segs.size(), spans.data(), h[2], partials.data(), (u32)h[5]);
				});
			}
			for (auto &t : lanes) t.join();
		}
	}
	for (u64 p : partials) printf("%016llx\n", (unsigned long long)p);
	return 0;
}
