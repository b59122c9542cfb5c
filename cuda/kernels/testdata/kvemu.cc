// kvemu.cc runs kvcopy.cu's kernels on the CPU for package cuda's tests
// (kernelemu_test.go), which have no GPU: every lane of a warp is a
// thread, the warp's shuffles meet at a barrier, a block's warps and the
// grid's blocks run one after the other (the kernels never synchronize
// beyond a warp), the atomics are the host's. The kernel source is
// compiled as it is, with KV_HOST_EMULATION and the intrinsics below.
//
//	kvemu KERNEL BLOCKS FILE    KERNEL: checksum | units | gather | scatter
//
// FILE is what the test wrote: a header of seven little-endian uint64
// (segments, spans, chunks, objects, image bytes, flags, host bytes), the
// segments as struct Seg, the spans as struct Span, the image (device
// memory: the pages) and the host buffer (the packed side of gather and
// scatter). The tables' addresses are offsets, relocated here: a span's
// ptr into the image, a segment's packed into the host buffer (gather,
// scatter) or a unit's into the image (units). kvemu prints every
// object's partial sum, one hexadecimal number a line, and writes the
// image and the host buffer back into FILE as the kernel left them.
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

// aligned16 returns a 16-aligned region of n bytes (and 16 of slack: an
// aligned 16-byte load of the last chunk stays inside) within v.
static unsigned char *aligned16(std::vector<unsigned char> &v, u64 n) {
	v.assign(n + 48, 0);
	return v.data() + (16 - (uintptr_t)v.data() % 16) % 16;
}

int main(int argc, char **argv) {
	if (argc != 4) {
		fprintf(stderr, "usage: kvemu checksum|units|gather|scatter BLOCKS FILE\n");
		return 2;
	}
	const char *name = argv[1];
	Kernel *k = strcmp(name, "units") == 0 ? kv_sum_units
	          : strcmp(name, "gather") == 0 ? kv_gather
	          : strcmp(name, "scatter") == 0 ? kv_scatter
	          : kv_checksum;
	unsigned blocks = (unsigned)atoi(argv[2]);
	FILE *f = fopen(argv[3], "rb");
	u64 h[7];
	if (!f || fread(h, 8, 7, f) != 7) {
		fprintf(stderr, "kvemu: cannot read %s\n", argv[3]);
		return 2;
	}
	std::vector<Seg> segs(h[0]);
	std::vector<Span> spans(h[1]);
	std::vector<u64> partials(h[3]);
	std::vector<unsigned char> imgv, hostv;
	unsigned char *img = aligned16(imgv, h[4]), *host = aligned16(hostv, h[6]);
	if (fread(segs.data(), sizeof(Seg), segs.size(), f) != segs.size() ||
	    fread(spans.data(), sizeof(Span), spans.size(), f) != spans.size() || fread(img, 1, h[4], f) != h[4] ||
	    fread(host, 1, h[6], f) != h[6]) {
		fprintf(stderr, "kvemu: %s is short\n", argv[3]);
		return 2;
	}
	fclose(f);
	if (k == kv_sum_units) {
		for (Seg &s : segs) s.packed += (u64)(uintptr_t)img;
	} else {
		for (Span &s : spans) s.ptr += (u64)(uintptr_t)img;
		if (k != kv_checksum)
			for (Seg &s : segs) s.packed += (u64)(uintptr_t)host;
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
	f = fopen(argv[3], "r+b");
	if (!f || fseek(f, (long)(8 * 7 + sizeof(Seg) * segs.size() + sizeof(Span) * spans.size()), SEEK_SET) != 0 ||
	    fwrite(img, 1, h[4], f) != h[4] || fwrite(host, 1, h[6], f) != h[6] || fclose(f) != 0) {
		fprintf(stderr, "kvemu: cannot write %s back\n", argv[3]);
		return 2;
	}
	return 0;
}
