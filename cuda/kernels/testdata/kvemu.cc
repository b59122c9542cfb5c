// kvemu.cc runs kvcopy.cu's kernels on the CPU for package cuda's tests
// (kernelemu_test.go), which have no GPU: every lane of a warp is a
// coroutine (ucontext) of one thread, and at each shuffle a lane leaves
// its value and passes to the next, so that a lane reads the others'
// values once all 32 have left theirs; a block's warps and the grid's
// blocks run one after the other (the kernels never synchronize beyond a
// warp). The kernels' shuffles are warp-uniform, as the hardware needs
// them to be, which this round robin relies on. The kernel source is
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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>

#define KV_HOST_EMULATION 1
#define KV_GLOBAL extern "C"
#define KV_DEVICE static inline
#define KV_GLOBAL_AS

// The warp being run: its lanes' contexts, their shuffle counts, and two
// exchange buffers used by turns (a lane writes one again only two
// shuffles later, when every lane has read it).
static ucontext_t main_, lanes_[32];
static unsigned turn_[32], xchg_[2][32];
static unsigned cur_, warp_, block_, blocks_;

static unsigned __nvvm_read_ptx_sreg_tid_x() { return warp_ * 32 + cur_; }
static unsigned __nvvm_read_ptx_sreg_laneid() { return cur_; }
static unsigned __nvvm_read_ptx_sreg_ctaid_x() { return block_; }
static unsigned __nvvm_read_ptx_sreg_nctaid_x() { return blocks_; }

// exchange leaves v for the others, passes to the next lane, and once
// every lane has left its value returns lane src's (v itself when src is
// outside the warp, as shfl.sync's clamp does).
static unsigned exchange(unsigned v, int src) {
	unsigned me = cur_;
	unsigned *x = xchg_[turn_[me]++ % 2];
	x[me] = v;
	cur_ = (me + 1) % 32;
	swapcontext(&lanes_[me], &lanes_[(me + 1) % 32]);
	cur_ = me;
	return (src >= 0 && src < 32) ? x[src] : v;
}
static unsigned __nvvm_shfl_sync_down_i32(unsigned, unsigned v, unsigned d, unsigned) {
	return exchange(v, (int)(cur_ + d));
}
static unsigned __nvvm_shfl_sync_up_i32(unsigned, unsigned v, unsigned d, unsigned) {
	return exchange(v, (int)cur_ - (int)d);
}
static long long __nvvm_atom_add_gen_ll(long long *p, long long v) {
	long long old = *p;
	*p = (long long)((unsigned long long)old + (unsigned long long)v);
	return old;
}

#include "../kvcopy.cu"

typedef void Kernel(const Seg *, u32, const Span *, u64, u64 *, u32);

// aligned16 returns a 16-aligned region of n bytes (and 16 of slack: an
// aligned 16-byte load of the last chunk stays inside) within v.
static unsigned char *aligned16(std::vector<unsigned char> &v, u64 n) {
	v.assign(n + 48, 0);
	return v.data() + (16 - (uintptr_t)v.data() % 16) % 16;
}

// move runs kv_move (kvemu move BLOCKS FILE DST SRC N): FILE is the whole
// memory, at a 16-aligned address; DST and SRC are offsets into it, N the
// bytes; the memory is written back as the kernel left it. Its lanes never
// shuffle, so each thread runs to its end in turn.
static int move(char **argv) {
	unsigned blocks = (unsigned)atoi(argv[2]);
	FILE *f = fopen(argv[3], "rb");
	if (!f || fseek(f, 0, SEEK_END) != 0) {
		fprintf(stderr, "kvemu: cannot read %s\n", argv[3]);
		return 2;
	}
	long size = ftell(f);
	rewind(f);
	std::vector<unsigned char> memv;
	unsigned char *mem = aligned16(memv, (u64)size);
	if (fread(mem, 1, (size_t)size, f) != (size_t)size) {
		fprintf(stderr, "kvemu: %s is short\n", argv[3]);
		return 2;
	}
	fclose(f);
	u64 dst = strtoull(argv[4], 0, 10), src = strtoull(argv[5], 0, 10), n = strtoull(argv[6], 0, 10);
	blocks_ = blocks;
	for (block_ = 0; block_ < blocks; block_++)
		for (warp_ = 0; warp_ < NT / 32; warp_++)
			for (cur_ = 0; cur_ < 32; cur_++) kv_move((u64)(uintptr_t)(mem + dst), (u64)(uintptr_t)(mem + src), n);
	f = fopen(argv[3], "wb");
	if (!f || fwrite(mem, 1, (size_t)size, f) != (size_t)size || fclose(f) != 0) {
		fprintf(stderr, "kvemu: cannot write %s back\n", argv[3]);
		return 2;
	}
	return 0;
}

int main(int argc, char **argv) {
	if (argc != 4 && argc != 7) {
		fprintf(stderr, "usage: kvemu checksum|units|gather|scatter BLOCKS FILE | move BLOCKS FILE DST SRC N\n");
		return 2;
	}
	if (argc == 7 && strcmp(argv[1], "move") == 0) return move(argv);
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
	// The kernel's arguments, for the lanes' entry.
	static Kernel *kern;
	static const Seg *a_segs;
	static u32 a_nsegs;
	static const Span *a_spans;
	static u64 a_nchunks, *a_partials;
	static u32 a_flags;
	kern = k, a_segs = segs.data(), a_nsegs = (u32)segs.size(), a_spans = spans.data(), a_nchunks = h[2],
	a_partials = partials.data(), a_flags = (u32)h[5];
	struct Entry {
		static void run(int lane) {
			cur_ = (unsigned)lane; // also when the lane before returned without a shuffle
			kern(a_segs, a_nsegs, a_spans, a_nchunks, a_partials, a_flags);
		}
	};
	std::vector<std::vector<char>> stacks(32, std::vector<char>(256 << 10));
	blocks_ = blocks;
	for (block_ = 0; block_ < blocks; block_++) {
		for (warp_ = 0; warp_ < NT / 32; warp_++) {
			// A lane that returns passes to the next; the last, back here.
			for (unsigned l = 0; l < 32; l++) {
				getcontext(&lanes_[l]);
				lanes_[l].uc_stack.ss_sp = stacks[l].data();
				lanes_[l].uc_stack.ss_size = stacks[l].size();
				lanes_[l].uc_link = l == 31 ? &main_ : &lanes_[l + 1];
				makecontext(&lanes_[l], (void (*)())Entry::run, 1, (int)l);
				turn_[l] = 0;
			}
			cur_ = 0;
			swapcontext(&main_, &lanes_[0]);
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
