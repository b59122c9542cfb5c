// Package kernels holds kvtier's CUDA copy kernels as PTX: kvcopy.cu,
// compiled by `make ptx` with clang-14 into kvcopy.ptx, which is committed
// and embedded here so that a binary needs neither a CUDA toolkit nor a
// compiler. The CUDA backend of package cuda JIT-loads it through the driver.
package kernels

import _ "embed"

// KVCopyPTX is the PTX of kvcopy.cu: entry points kv_gather, kv_scatter,
// kv_checksum and kv_delay.
//
//go:embed kvcopy.ptx
var KVCopyPTX string
