package powercut

import (
	"maps"
	"slices"
	"sync"
	"syscall"
	"time"
)

// pageSize is the unit of the modelled page cache.
const pageSize = 4096

// rootIno is the root directory's inode number (FUSE's root node id).
const rootIno = 1

// content is a file's bytes: sparse pages of pageSize bytes and a size.
// Bytes past size inside an existing page are always zero (truncate
// clears them), so growing a file exposes zeros, as it must.
type content struct {
	pages map[int64][]byte
	size  int64
}

// record is what a power cut leaves of an inode: what its last fsync (or,
// for an inode never synced, the directory fsync that first made a name of
// it durable) recorded. A file's pages are never written once recorded
// (copy on write), so records share them with the running file.
type record struct {
	mode     uint32 // type and permission bits
	uid, gid uint32
	mtime    time.Time
	data     content          // files
	entries  map[string]*node // directories: the names a power cut keeps
}

// node is an inode of one mount generation, as the running system sees it.
type node struct {
	ino      uint64
	dir      bool
	mode     uint32 // type and permission bits
	uid, gid uint32
	mtime    time.Time
	nlink    uint32 // files: names in the running view

	data  content        // files: the running bytes
	owned map[int64]bool // files: pages written since the last fsync (not shared with durable)

	entries map[string]*node // directories: the running names

	durable *record // nil: no durable trace (never synced, no durable name)
}

// generation is one mount: the running view since the last crash.
type generation struct {
	nodes map[uint64]*node
	root  *node
	cut   bool // power cut: every mutation fails with EIO, nothing changes
}

// model is the file system: the running view of the current generation
// and, in each node, its durable record. It is the whole semantics; the
// FUSE layer only translates requests.
type model struct {
	mu      sync.Mutex // guards everything below and every node of every generation
	gen     *generation
	nextIno uint64
	ops     int64 // mutating operations attempted since the start
	cutAt   int64 // when ops reaches it, the power is cut; 0: never
}

func newModel(uid, gid uint32) *model {
	m := &model{nextIno: rootIno + 1}
	root := &node{ino: rootIno, dir: true, mode: syscall.S_IFDIR | 0o755, uid: uid, gid: gid,
		mtime: time.Now(), entries: map[string]*node{}}
	root.durable = root.record()
	m.gen = &generation{nodes: map[uint64]*node{rootIno: root}, root: root}
	return m
}

// mutate counts a mutating operation of g and says whether it may happen:
// EIO when the power of g is (now) cut. Called with m.mu held.
func (m *model) mutate(g *generation) syscall.Errno {
	if g.cut {
		return syscall.EIO
	}
	m.ops++
	if m.cutAt > 0 && m.ops >= m.cutAt {
		g.cut = true
		return syscall.EIO
	}
	return 0
}

// cutAfter arranges for the power to be cut at the (n+1)th mutating
// operation from now: the next n happen, that one and every later one
// fail with EIO.
func (m *model) cutAfter(n int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cutAt = m.ops + n + 1
}

// cutNow cuts the power of the running generation.
func (m *model) cutNow() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gen.cut = true
}

// state returns the mutating operations counted so far and whether the
// running generation's power is cut.
func (m *model) state() (ops int64, cut bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ops, m.gen.cut
}

// crash cuts the power of the running generation and starts a new one
// holding only what was durable: every inode reachable from the root
// through durable names, with its recorded content, except that a file
// keeps the size it had at the cut (zeros past its recorded bytes, its
// recorded bytes cut at a smaller size). It returns the new
// generation; the old one stays cut forever (its open files keep reading
// what they saw, and can change nothing).
func (m *model) crash() *generation {
	m.mu.Lock()
	defer m.mu.Unlock()
	old := m.gen
	old.cut = true
	g := &generation{nodes: map[uint64]*node{}}
	built := map[*node]*node{} // a file durably named in two directories is one inode
	var build func(o *node) *node
	build = func(o *node) *node {
		if n, ok := built[o]; ok {
			n.nlink++
			return n
		}
		r := o.durable
		n := &node{ino: o.ino, dir: o.dir, mode: r.mode, uid: r.uid, gid: r.gid, mtime: r.mtime}
		built[o] = n
		g.nodes[n.ino] = n
		if o.dir {
			n.entries = make(map[string]*node, len(r.entries))
			for _, name := range slices.Sorted(maps.Keys(r.entries)) {
				n.entries[name] = build(r.entries[name])
			}
			n.durable = n.record()
		} else {
			// The size as it ran (metadata can reach the disk without the
			// data), the bytes of the last fsync: zeros where it had none.
			n.nlink = 1
			n.data = content{pages: maps.Clone(r.data.pages), size: r.data.size}
			n.truncate(o.data.size)
			n.owned = nil
			n.durable = n.record()
		}
		return n
	}
	g.root = build(old.root)
	m.cutAt = 0
	m.gen = g
	return g
}

// record returns n's running state as a durable record. Directory entries
// are copied; file pages are shared, so the caller must clear n.owned.
func (n *node) record() *record {
	r := &record{mode: n.mode, uid: n.uid, gid: n.gid, mtime: n.mtime}
	if n.dir {
		r.entries = maps.Clone(n.entries)
	} else {
		r.data = content{pages: maps.Clone(n.data.pages), size: n.data.size}
	}
	return r
}

// fsync makes n durable: a file's bytes, size and attributes; a
// directory's names (each pointing at its inode, whose own content is
// whatever that inode last recorded) and attributes. A name made durable
// for an inode with no record yet records it empty: a file created and
// named durably but never synced comes back empty after a crash.
func (m *model) fsync(g *generation, ino uint64) syscall.Errno {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := g.nodes[ino]
	if n == nil {
		return syscall.ENOENT
	}
	if e := m.mutate(g); e != 0 {
		return e
	}
	n.durable = n.record()
	if n.dir {
		for _, c := range n.entries {
			if c.durable == nil {
				c.durable = &record{mode: c.mode, uid: c.uid, gid: c.gid, mtime: c.mtime}
				if c.dir {
					c.durable.entries = map[string]*node{}
				}
			}
		}
	} else {
		n.owned = nil
	}
	return 0
}

func (m *model) node(g *generation, ino uint64) (*node, syscall.Errno) {
	n := g.nodes[ino]
	if n == nil {
		return nil, syscall.ENOENT
	}
	return n, 0
}

func (m *model) dirNode(g *generation, ino uint64) (*node, syscall.Errno) {
	n := g.nodes[ino]
	switch {
	case n == nil:
		return nil, syscall.ENOENT
	case !n.dir:
		return nil, syscall.ENOTDIR
	}
	return n, 0
}

// attr is a copy of what stat reports for an inode.
type attr struct {
	ino      uint64
	mode     uint32
	uid, gid uint32
	size     int64
	nlink    uint32
	mtime    time.Time
}

func (n *node) attr() attr {
	a := attr{ino: n.ino, mode: n.mode, uid: n.uid, gid: n.gid, size: n.data.size, nlink: n.nlink, mtime: n.mtime}
	if n.dir {
		a.size = 4096
		a.nlink = 2
		for _, c := range n.entries {
			if c.dir {
				a.nlink++
			}
		}
	}
	return a
}

func (m *model) getattr(g *generation, ino uint64) (attr, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, e := m.node(g, ino)
	if e != 0 {
		return attr{}, e
	}
	return n.attr(), 0
}

func (m *model) lookup(g *generation, parent uint64, name string) (attr, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, e := m.dirNode(g, parent)
	if e != 0 {
		return attr{}, e
	}
	c := p.entries[name]
	if c == nil {
		return attr{}, syscall.ENOENT
	}
	return c.attr(), 0
}

// setattr changes what is set: size (truncate), mode bits, owner, mtime.
func (m *model) setattr(g *generation, ino uint64, size *int64, mode, uid, gid *uint32, mtime *time.Time) (attr, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, e := m.node(g, ino)
	if e != 0 {
		return attr{}, e
	}
	if size != nil && n.dir {
		return attr{}, syscall.EISDIR
	}
	if size != nil && *size < 0 {
		return attr{}, syscall.EINVAL
	}
	if e := m.mutate(g); e != 0 {
		return attr{}, e
	}
	if size != nil {
		n.truncate(*size)
		n.mtime = time.Now()
	}
	if mode != nil {
		n.mode = n.mode&syscall.S_IFMT | *mode&0o7777
	}
	if uid != nil {
		n.uid = *uid
	}
	if gid != nil {
		n.gid = *gid
	}
	if mtime != nil {
		n.mtime = *mtime
	}
	return n.attr(), 0
}

// add creates a file or directory name in parent.
func (m *model) add(g *generation, parent uint64, name string, dir bool, mode, uid, gid uint32) (attr, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, e := m.dirNode(g, parent)
	if e != 0 {
		return attr{}, e
	}
	if p.entries[name] != nil {
		return attr{}, syscall.EEXIST
	}
	if e := m.mutate(g); e != 0 {
		return attr{}, e
	}
	n := &node{ino: m.nextIno, dir: dir, uid: uid, gid: gid, mtime: time.Now()}
	m.nextIno++
	if dir {
		n.mode = syscall.S_IFDIR | mode&0o7777
		n.entries = map[string]*node{}
	} else {
		n.mode = syscall.S_IFREG | mode&0o7777
		n.nlink = 1
	}
	g.nodes[n.ino] = n
	p.entries[name] = n
	p.mtime = n.mtime
	return n.attr(), 0
}

// remove unlinks a file (dir false) or removes an empty directory.
func (m *model) remove(g *generation, parent uint64, name string, dir bool) syscall.Errno {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, e := m.dirNode(g, parent)
	if e != 0 {
		return e
	}
	c := p.entries[name]
	switch {
	case c == nil:
		return syscall.ENOENT
	case dir && !c.dir:
		return syscall.ENOTDIR
	case !dir && c.dir:
		return syscall.EISDIR
	case dir && len(c.entries) > 0:
		return syscall.ENOTEMPTY
	}
	if e := m.mutate(g); e != 0 {
		return e
	}
	delete(p.entries, name)
	if !c.dir {
		c.nlink--
	}
	p.mtime = time.Now()
	return 0
}

// Rename flags (renameat2).
const (
	renameNoReplace = 1
	renameExchange  = 2
)

// rename moves a name. A directory may be renamed only within its parent
// (EXDEV otherwise): a directory has one parent, so it cannot be durably
// named in two places at a crash.
func (m *model) rename(g *generation, oldParent uint64, oldName string, newParent uint64, newName string, flags uint32) syscall.Errno {
	m.mu.Lock()
	defer m.mu.Unlock()
	op, e := m.dirNode(g, oldParent)
	if e != 0 {
		return e
	}
	np, e := m.dirNode(g, newParent)
	if e != 0 {
		return e
	}
	src := op.entries[oldName]
	if src == nil {
		return syscall.ENOENT
	}
	if flags&^renameNoReplace != 0 {
		return syscall.EINVAL
	}
	if src.dir && op != np {
		return syscall.EXDEV
	}
	dst := np.entries[newName]
	if dst == src {
		return 0
	}
	if dst != nil {
		switch {
		case flags&renameNoReplace != 0:
			return syscall.EEXIST
		case dst.dir && !src.dir:
			return syscall.EISDIR
		case !dst.dir && src.dir:
			return syscall.ENOTDIR
		case dst.dir && len(dst.entries) > 0:
			return syscall.ENOTEMPTY
		}
	}
	if e := m.mutate(g); e != 0 {
		return e
	}
	if dst != nil && !dst.dir {
		dst.nlink--
	}
	delete(op.entries, oldName)
	np.entries[newName] = src
	now := time.Now()
	op.mtime, np.mtime = now, now
	return 0
}

// readdir lists a directory's running names, sorted.
func (m *model) readdir(g *generation, ino uint64) ([]string, []attr, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, e := m.dirNode(g, ino)
	if e != 0 {
		return nil, nil, e
	}
	names := slices.Sorted(maps.Keys(n.entries))
	attrs := make([]attr, len(names))
	for i, name := range names {
		attrs[i] = n.entries[name].attr()
	}
	return names, attrs, 0
}

// truncateOpen handles O_TRUNC at open.
func (m *model) truncateOpen(g *generation, ino uint64) syscall.Errno {
	zero := int64(0)
	_, e := m.setattr(g, ino, &zero, nil, nil, nil, nil)
	return e
}

func (m *model) read(g *generation, ino uint64, off int64, size int) ([]byte, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, e := m.node(g, ino)
	if e != 0 {
		return nil, e
	}
	if n.dir {
		return nil, syscall.EISDIR
	}
	return n.data.read(off, size), 0
}

func (m *model) write(g *generation, ino uint64, off int64, p []byte) (int, syscall.Errno) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, e := m.node(g, ino)
	if e != 0 {
		return 0, e
	}
	if n.dir {
		return 0, syscall.EISDIR
	}
	if off < 0 {
		return 0, syscall.EINVAL
	}
	if e := m.mutate(g); e != 0 {
		return 0, e
	}
	n.write(off, p)
	n.mtime = time.Now()
	return len(p), 0
}

func (c *content) read(off int64, size int) []byte {
	if off >= c.size || size <= 0 {
		return nil
	}
	end := min(off+int64(size), c.size)
	out := make([]byte, end-off)
	for pos := off; pos < end; {
		pi, po := pos/pageSize, pos%pageSize
		k := min(pageSize-po, end-pos)
		if pg := c.pages[pi]; pg != nil {
			copy(out[pos-off:pos-off+k], pg[po:po+k])
		}
		pos += k
	}
	return out
}

// ownPage returns page pi of n's running bytes, copied first when it is
// shared with the durable record.
func (n *node) ownPage(pi int64) []byte {
	pg := n.data.pages[pi]
	if n.owned[pi] {
		return pg
	}
	cp := make([]byte, pageSize)
	copy(cp, pg)
	if n.data.pages == nil {
		n.data.pages = map[int64][]byte{}
	}
	if n.owned == nil {
		n.owned = map[int64]bool{}
	}
	n.data.pages[pi] = cp
	n.owned[pi] = true
	return cp
}

func (n *node) write(off int64, p []byte) {
	end := off + int64(len(p))
	for pos := off; pos < end; {
		pi, po := pos/pageSize, pos%pageSize
		k := min(pageSize-po, end-pos)
		copy(n.ownPage(pi)[po:po+k], p[pos-off:pos-off+k])
		pos += k
	}
	if end > n.data.size {
		n.data.size = end
	}
}

func (n *node) truncate(size int64) {
	if size < n.data.size {
		keep := (size + pageSize - 1) / pageSize // pages wholly or partly below size
		for pi := range n.data.pages {
			if pi >= keep {
				delete(n.data.pages, pi)
				delete(n.owned, pi)
			}
		}
		if po := size % pageSize; po != 0 && n.data.pages[size/pageSize] != nil {
			clear(n.ownPage(size / pageSize)[po:])
		}
	}
	n.data.size = size
}
