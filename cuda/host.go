package cuda

import (
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
)

// HostConfig configures the host backend (OpenHost). The zero value means
// "all defaults" (see DefaultHostConfig).
type HostConfig struct {
	// Dir holds the files that make device memory and interprocess events
	// shareable across processes: one file per allocation or event, named
	// kvtier-<pid>-<random> (SweepStaleHost removes those of dead
	// processes). Processes that share memory must use the same Dir and
	// run as the same user (files are 0600). It must be private: owned by
	// the process's uid, mode 0700, not a symlink (imports refuse symlinks,
	// foreign owners and files open to group or others). It should be a
	// tmpfs, where the files are plain memory; a disk directory works but
	// its pages are written back. Default DefaultHostDir()
	// (/dev/shm/kvtier-<uid>, created 0700); tests use t.TempDir().
	Dir string
	// UUID is Info().UUID and is carried in every handle; ImportMem and
	// ImportEvent accept only handles with the same UUID, as a GPU can open
	// only its own memory. Default "HOST-" + 16 hex digits of a hash of the
	// hostname: stable across processes and restarts on one machine. Give
	// distinct values to simulate several GPUs on one machine.
	UUID string
	// Name is Info().Name. Default "kvtier host simulator".
	Name string
	// Memory is Info().Memory in bytes. It is informational: allocations
	// are bounded by the filesystem of Dir, and Alloc fails cleanly when it
	// is full. Default: the size of that filesystem.
	Memory uint64
}

// DefaultHostConfig returns the defaults documented on HostConfig.
func DefaultHostConfig() HostConfig {
	var c HostConfig
	c.applyDefaults()
	return c
}

func (c *HostConfig) applyDefaults() {
	if c.Dir == "" {
		c.Dir = DefaultHostDir()
	}
	if c.UUID == "" {
		host, err := os.Hostname()
		if err != nil {
			host = "localhost"
		}
		h := fnv.New64a()
		h.Write([]byte(host))
		c.UUID = fmt.Sprintf("HOST-%016x", h.Sum64())
	}
	if c.Name == "" {
		c.Name = "kvtier host simulator"
	}
	if c.Memory == 0 {
		var st syscall.Statfs_t
		if syscall.Statfs(c.Dir, &st) == nil {
			c.Memory = st.Blocks * uint64(st.Bsize)
		}
	}
}

// Validate reports whether c (after defaults) names an existing directory
// and a usable UUID.
func (c HostConfig) Validate() error {
	c.applyDefaults()
	if err := checkPrivateDir(c.Dir); err != nil {
		return err
	}
	for _, r := range c.UUID {
		if r <= ' ' || r == '/' || r > '~' {
			return fmt.Errorf("%w: host UUID %q: only printable ASCII without '/' and spaces", ErrBadSpec, c.UUID)
		}
	}
	return nil
}

// OpenHost opens the host backend: a simulator of a GPU that runs kvtier's
// device code paths on the CPU, with the semantics of the CUDA backend
// wherever they are observable, and stricter where CUDA would fail silently:
//
//   - Memory. Alloc creates and maps a file kvtier-<pid>-<random> in
//     cfg.Dir; ExportMem names it (MemHandle.Raw) with the view's offset and
//     size, and ImportMem in any process maps exactly that view. Release of
//     an allocation removes the file at once; views already imported, and
//     copies already enqueued, keep working until they are done.
//     AllocHost memory is ordinary process memory.
//   - Streams. One goroutine per stream runs its operations in order.
//     Gather and Scatter validate everything (ranges, released memory,
//     overlapping destinations, also through aliasing views) before they
//     enqueue, copy with copy() and hash with kvsum64. Close cuts Delays
//     short and fails waits on events that have not completed, so it
//     never blocks on another stream or process.
//   - Events. Records are numbered when Record is called; WaitEvent waits
//     for the most recent one at the time of the call (none: no wait). An
//     interprocess event is a file of atomic counters that importers poll.
//     A wait on an event that was released here, destroyed by its owner or
//     whose owner process died fails with ErrReleased, and so does the
//     stream: everything after the wait fails with ErrStreamFailed (C1).
//     A record abandoned by a failed stream fails the waits for it.
//     Only the owner records an event.
//
// Files of crashed processes are removed by SweepStaleHost.
func OpenHost(cfg HostConfig) (Device, error) {
	cfg.applyDefaults()
	if err := ensureHostDir(cfg.Dir); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d := &hostDevice{
		cfg: cfg,
		info: Info{
			Backend: "host",
			UUID:    cfg.UUID,
			Name:    cfg.Name,
			Memory:  cfg.Memory,
		},
		res: resourceSet{name: "host device " + cfg.UUID},
	}
	return d, nil
}

// hostDevice implements Device on the CPU.
type hostDevice struct {
	cfg  HostConfig
	info Info
	res  resourceSet // its memory, host buffers, streams and events
	// path chooses the copy path of Gather and Scatter as the CUDA
	// backend does (dma_plan.go); tests force one. Set before the device
	// is shared.
	path copyPath
}

var streamIDs atomic.Uint64

func (d *hostDevice) Info() Info { return d.info }

func (d *hostDevice) Alloc(size uint64) (Mem, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	if size == 0 {
		return nil, fmt.Errorf("%w: Alloc of 0 B", ErrOutOfRange)
	}
	name, err := newShmName(false)
	if err != nil {
		return nil, err
	}
	f, err := createShmFile(d.cfg.Dir, name, size)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mapping, view, err := mapFile(f, 0, size)
	if err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	m := &hostMem{dev: d, name: name, size: size, data: view, mapping: mapping, path: f.Name()}
	if err := d.res.add(m); err != nil {
		m.Release()
		return nil, err
	}
	return m, nil
}

func (d *hostDevice) AllocHost(size uint64) (HostBuf, error) {
	if size == 0 {
		return nil, fmt.Errorf("%w: AllocHost of 0 B", ErrOutOfRange)
	}
	if size > uint64(maxInt) {
		return nil, fmt.Errorf("%w: AllocHost of %d B exceeds the address space", ErrOutOfRange, size)
	}
	b := &hostBuf{dev: d, b: make([]byte, size)}
	if err := d.res.add(b); err != nil {
		return nil, err
	}
	return b, nil
}

func (d *hostDevice) NewStream() (Stream, error) {
	s := newHostStream(d)
	if err := d.res.add(s); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

func (d *hostDevice) NewEvent(interprocess bool) (Event, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	e, err := newHostEvent(d, interprocess)
	if err != nil {
		return nil, err
	}
	if err := d.res.add(e); err != nil {
		e.Release()
		return nil, err
	}
	return e, nil
}

func (d *hostDevice) ExportMem(m Mem, off, size uint64) (MemHandle, error) {
	hm, err := asHostMem(m, "ExportMem")
	if err != nil {
		return MemHandle{}, err
	}
	if hm.imported {
		return MemHandle{}, fmt.Errorf("%w: ExportMem of an imported view (export from the owning process)", ErrBadHandle)
	}
	if size == 0 || off > hm.size || size > hm.size-off {
		return MemHandle{}, fmt.Errorf("%w: ExportMem view [%d, +%d B) of a %d B allocation", ErrOutOfRange, off, size, hm.size)
	}
	if err := hm.acquire(); err != nil {
		return MemHandle{}, fmt.Errorf("ExportMem: %w", err)
	}
	hm.unref()
	return MemHandle{
		Backend: "host",
		Device:  hm.dev.info.UUID,
		Raw:     []byte(hm.name),
		Offset:  hm.off + off,
		Size:    size,
	}, nil
}

func (d *hostDevice) checkHandle(backend, dev string, raw []byte, wantEvent bool) (name string, pid int, err error) {
	if backend != "host" {
		return "", 0, fmt.Errorf("%w: backend %q, want \"host\"", ErrBadHandle, backend)
	}
	if dev != d.info.UUID {
		return "", 0, fmt.Errorf("%w: handle of device %q opened on device %q", ErrBadHandle, dev, d.info.UUID)
	}
	name = string(raw)
	pid, event, ok := parseShmName(name)
	if !ok || event != wantEvent {
		kind := "memory"
		if wantEvent {
			kind = "event"
		}
		return "", 0, fmt.Errorf("%w: %q is not a host %s handle", ErrBadHandle, name, kind)
	}
	return name, pid, nil
}

func (d *hostDevice) ImportMem(h MemHandle) (Mem, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	name, _, err := d.checkHandle(h.Backend, h.Device, h.Raw, false)
	if err != nil {
		return nil, err
	}
	if h.Size == 0 || h.Offset+h.Size < h.Offset {
		return nil, fmt.Errorf("%w: view [%d, +%d B)", ErrBadHandle, h.Offset, h.Size)
	}
	f, err := openShmFile(d.cfg.Dir, name, "memory")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: memory %s: %w", ErrBadHandle, name, err)
	}
	if uint64(fi.Size()) < h.Offset+h.Size {
		return nil, fmt.Errorf("%w: view [%d, %d) of memory %s that has %d B", ErrBadHandle, h.Offset, h.Offset+h.Size, name, fi.Size())
	}
	mapping, view, err := mapFile(f, h.Offset, h.Size)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadHandle, err)
	}
	m := &hostMem{dev: d, name: name, off: h.Offset, size: h.Size, data: view, mapping: mapping, imported: true}
	if err := d.res.add(m); err != nil {
		m.Release()
		return nil, err
	}
	return m, nil
}

func (d *hostDevice) ExportEvent(e Event) (EventHandle, error) {
	he, ok := e.(*hostEvent)
	if !ok || he == nil {
		return EventHandle{}, fmt.Errorf("%w: ExportEvent of a %T, not a host event", ErrBadHandle, e)
	}
	if he.name == "" || he.imported {
		return EventHandle{}, fmt.Errorf("%w: ExportEvent needs an interprocess event created by this process", ErrBadHandle)
	}
	if err := he.checkLive(); err != nil {
		return EventHandle{}, fmt.Errorf("ExportEvent: %w", err)
	}
	return EventHandle{Backend: "host", Device: he.dev.info.UUID, Raw: []byte(he.name)}, nil
}

func (d *hostDevice) ImportEvent(h EventHandle) (Event, error) {
	if d.res.isClosed() {
		return nil, d.res.errClosed()
	}
	name, pid, err := d.checkHandle(h.Backend, h.Device, h.Raw, true)
	if err != nil {
		return nil, err
	}
	e, err := importHostEvent(d, name, pid)
	if err != nil {
		return nil, err
	}
	if err := d.res.add(e); err != nil {
		e.Release()
		return nil, err
	}
	return e, nil
}

func asHostMem(m Mem, what string) (*hostMem, error) {
	hm, ok := m.(*hostMem)
	if !ok || hm == nil {
		return nil, fmt.Errorf("%w: %s of a %T, not host backend memory", ErrBadHandle, what, m)
	}
	return hm, nil
}

func (d *hostDevice) Write(dst Mem, off uint64, src []byte) error {
	hm, err := asHostMem(dst, "Write")
	if err != nil {
		return err
	}
	if err := checkRange(off, uint64(len(src)), hm.size); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	if err := hm.acquire(); err != nil {
		return fmt.Errorf("Write: %w", err)
	}
	defer hm.unref()
	copy(hm.data[off:], src)
	return nil
}

func (d *hostDevice) Read(src Mem, off uint64, dst []byte) error {
	hm, err := asHostMem(src, "Read")
	if err != nil {
		return err
	}
	if err := checkRange(off, uint64(len(dst)), hm.size); err != nil {
		return fmt.Errorf("Read: %w", err)
	}
	if err := hm.acquire(); err != nil {
		return fmt.Errorf("Read: %w", err)
	}
	defer hm.unref()
	copy(dst, hm.data[off:off+uint64(len(dst))])
	return nil
}

// checkRange checks that [off, off+n) lies inside size bytes.
func checkRange(off, n, size uint64) error {
	if off > size || n > size-off {
		return fmt.Errorf("%w: [%d, %d) outside %d B", ErrOutOfRange, off, off+n, size)
	}
	return nil
}

// Close closes every stream (cutting Delays short and failing work still
// waiting on events), destroys the events this process created, closes
// imported events and views, frees allocations (removing their files) and
// host buffers. It is idempotent.
func (d *hostDevice) Close() error {
	if !d.res.close() {
		return nil
	}
	streams, events, mems, bufs := liveOf[*hostStream](&d.res), liveOf[*hostEvent](&d.res), liveOf[*hostMem](&d.res), liveOf[*hostBuf](&d.res)

	var errs []error
	for _, s := range streams {
		errs = append(errs, s.Close())
	}
	for _, e := range events {
		errs = append(errs, e.Release())
	}
	for _, m := range mems {
		errs = append(errs, m.Release())
	}
	for _, b := range bufs {
		errs = append(errs, b.Release())
	}
	for _, t := range liveOf[*hostTimer](&d.res) {
		errs = append(errs, t.Release())
	}
	return errors.Join(errs...)
}

// hostBuf is "pinned" host memory: ordinary Go memory on the host backend.
type hostBuf struct {
	dev *hostDevice
	b   []byte

	mu       sync.Mutex // guards released
	released bool
}

func (b *hostBuf) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.released {
		return nil
	}
	return b.b
}

func (b *hostBuf) Release() error {
	b.mu.Lock()
	was := b.released
	b.released = true
	b.mu.Unlock()
	if !was {
		b.dev.res.remove(b)
	}
	return nil
}

// hostBytes returns the memory of a host buffer for a transfer, or an error
// for a released one. Buffers of other backends are used through Bytes.
func hostBytes(h HostBuf) ([]byte, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil host buffer", ErrBadHandle)
	}
	if hb, ok := h.(*hostBuf); ok {
		hb.mu.Lock()
		defer hb.mu.Unlock()
		if hb.released {
			return nil, fmt.Errorf("%w: host buffer of %d B", ErrReleased, len(hb.b))
		}
		return hb.b, nil
	}
	b := h.Bytes()
	if b == nil {
		return nil, fmt.Errorf("%w: host buffer (%T) has no memory", ErrReleased, h)
	}
	return b, nil
}
