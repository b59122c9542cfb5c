package powercut

import (
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// rawFS serves one mount generation of the model over FUSE. Node ids are
// the model's inode numbers; nothing is cached by the kernel beyond a
// request (timeouts zero), and files are opened without direct I/O so
// that mmap works (bbolt reads through it).
type rawFS struct {
	fuse.RawFileSystem // ENOSYS for what is not modelled (links, xattrs, locks)
	m                  *model
	g                  *generation
}

func newRawFS(m *model, g *generation) *rawFS {
	return &rawFS{RawFileSystem: fuse.NewDefaultRawFileSystem(), m: m, g: g}
}

func (fs *rawFS) String() string { return "powercut" }

func status(e syscall.Errno) fuse.Status { return fuse.Status(e) }

func fillAttr(a attr, out *fuse.Attr) {
	out.Ino = a.ino
	out.Size = uint64(a.size)
	out.Blocks = (uint64(a.size) + 511) / 512
	sec, nsec := uint64(a.mtime.Unix()), uint32(a.mtime.Nanosecond())
	out.Atime, out.Mtime, out.Ctime = sec, sec, sec
	out.Atimensec, out.Mtimensec, out.Ctimensec = nsec, nsec, nsec
	out.Mode = a.mode
	out.Nlink = a.nlink
	out.Uid, out.Gid = a.uid, a.gid
	out.Blksize = pageSize
}

func fillEntry(a attr, out *fuse.EntryOut) {
	out.NodeId = a.ino
	fillAttr(a, &out.Attr)
}

func (fs *rawFS) Lookup(_ <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	a, e := fs.m.lookup(fs.g, h.NodeId, name)
	if e != 0 {
		return status(e)
	}
	fillEntry(a, out)
	return fuse.OK
}

func (fs *rawFS) Forget(nodeid, nlookup uint64) {}

func (fs *rawFS) GetAttr(_ <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	a, e := fs.m.getattr(fs.g, in.NodeId)
	if e != 0 {
		return status(e)
	}
	fillAttr(a, &out.Attr)
	return fuse.OK
}

func (fs *rawFS) SetAttr(_ <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	var size *int64
	var mode, uid, gid *uint32
	var mtime *time.Time
	if v, ok := in.GetSize(); ok {
		s := int64(v)
		size = &s
	}
	if v, ok := in.GetMode(); ok {
		mode = &v
	}
	if v, ok := in.GetUID(); ok {
		uid = &v
	}
	if v, ok := in.GetGID(); ok {
		gid = &v
	}
	if v, ok := in.GetMTime(); ok {
		mtime = &v
	}
	a, e := fs.m.setattr(fs.g, in.NodeId, size, mode, uid, gid, mtime)
	if e != 0 {
		return status(e)
	}
	fillAttr(a, &out.Attr)
	return fuse.OK
}

func (fs *rawFS) Mkdir(_ <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	a, e := fs.m.add(fs.g, in.NodeId, name, true, in.Mode, in.Uid, in.Gid)
	if e != 0 {
		return status(e)
	}
	fillEntry(a, out)
	return fuse.OK
}

func (fs *rawFS) Create(_ <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	a, e := fs.m.add(fs.g, in.NodeId, name, false, in.Mode, in.Uid, in.Gid)
	if e == syscall.EEXIST && in.Flags&syscall.O_EXCL == 0 { // raced with another create: open it
		if a, e = fs.m.lookup(fs.g, in.NodeId, name); e == 0 && a.mode&syscall.S_IFMT == syscall.S_IFDIR {
			e = syscall.EISDIR
		}
		if e == 0 && in.Flags&syscall.O_TRUNC != 0 {
			e = fs.m.truncateOpen(fs.g, a.ino)
		}
	}
	if e != 0 {
		return status(e)
	}
	fillEntry(a, &out.EntryOut)
	return fuse.OK
}

func (fs *rawFS) Unlink(_ <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	return status(fs.m.remove(fs.g, h.NodeId, name, false))
}

func (fs *rawFS) Rmdir(_ <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	return status(fs.m.remove(fs.g, h.NodeId, name, true))
}

func (fs *rawFS) Rename(_ <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	return status(fs.m.rename(fs.g, in.NodeId, oldName, in.Newdir, newName, in.Flags))
}

func (fs *rawFS) Access(_ <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	_, e := fs.m.getattr(fs.g, in.NodeId)
	return status(e)
}

func (fs *rawFS) Open(_ <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	a, e := fs.m.getattr(fs.g, in.NodeId)
	if e == 0 && a.mode&syscall.S_IFMT == syscall.S_IFDIR {
		e = syscall.EISDIR
	}
	if e == 0 && in.Flags&syscall.O_TRUNC != 0 {
		e = fs.m.truncateOpen(fs.g, in.NodeId)
	}
	return status(e) // no FOPEN_DIRECT_IO: reads go through the kernel's page cache, so mmap works
}

func (fs *rawFS) Read(_ <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	b, e := fs.m.read(fs.g, in.NodeId, int64(in.Offset), int(in.Size))
	if e != 0 {
		return nil, status(e)
	}
	return fuse.ReadResultData(b), fuse.OK
}

func (fs *rawFS) Write(_ <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	n, e := fs.m.write(fs.g, in.NodeId, int64(in.Offset), data)
	return uint32(n), status(e)
}

func (fs *rawFS) Flush(_ <-chan struct{}, in *fuse.FlushIn) fuse.Status { return fuse.OK } // close is not a sync
func (fs *rawFS) Release(_ <-chan struct{}, in *fuse.ReleaseIn)         {}

func (fs *rawFS) Fsync(_ <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	return status(fs.m.fsync(fs.g, in.NodeId))
}

func (fs *rawFS) OpenDir(_ <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	a, e := fs.m.getattr(fs.g, in.NodeId)
	if e == 0 && a.mode&syscall.S_IFMT != syscall.S_IFDIR {
		e = syscall.ENOTDIR
	}
	return status(e)
}

func (fs *rawFS) ReadDir(_ <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	names, attrs, e := fs.m.readdir(fs.g, in.NodeId)
	if e != 0 {
		return status(e)
	}
	for i := int(in.Offset); i < len(names); i++ {
		if !out.AddDirEntry(fuse.DirEntry{Name: names[i], Mode: attrs[i].mode, Ino: attrs[i].ino, Off: uint64(i + 1)}) {
			break
		}
	}
	return fuse.OK
}

func (fs *rawFS) ReleaseDir(in *fuse.ReleaseIn) {}

func (fs *rawFS) FsyncDir(_ <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	return status(fs.m.fsync(fs.g, in.NodeId))
}

func (fs *rawFS) StatFs(_ <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	const blocks = 1 << 30 // 4 TiB of 4 KiB blocks: never full
	*out = fuse.StatfsOut{Blocks: blocks, Bfree: blocks, Bavail: blocks, Files: 1 << 30, Ffree: 1 << 30,
		Bsize: pageSize, NameLen: 255, Frsize: pageSize}
	return fuse.OK
}
