// Package cuda is kvtier's device abstraction: device memory, pinned host
// buffers, streams, events, timers (when the device reached a point of a
// stream, on the host clock), CUDA IPC handles and the two transfer
// operations of the project, Gather (pages -> packed host object) and
// Scatter (packed host object -> pages), each computing the kvsum64
// checksum of the packed bytes as it copies.
//
// Two backends implement Device:
//   - the host backend (OpenHost), a faithful simulator that runs the same
//     code paths on the CPU: streams execute in order and asynchronously,
//     events complete when their stream reaches them, device memory and events
//     are shareable across processes through /dev/shm; waiting on a released
//     or destroyed event is an error (contract C1);
//   - the CUDA backend (OpenCUDA), the driver API through dlopen("libcuda.so.1")
//     with copy kernels JIT-loaded from committed PTX.
//
// A transfer takes one of two copy paths (Op.Path), by a rule both backends
// share (dma_plan.go): the copy kernels, which checksum as they copy, or,
// where the spans make long runs contiguous on both sides, copy-engine
// copies (one per run, 2D for rows at one pitch) followed by a checksum
// kernel that reads the pages in device memory. Both give the same bytes
// and sums.
//
// The package validates every transfer before it enqueues any copy: a span
// outside its allocation is rejected and nothing is written. It never
// interprets geometry (that is dcp's) and never decides what to store (that is
// transfer's).
package cuda
