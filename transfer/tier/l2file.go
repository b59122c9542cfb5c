package tier

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/wire"
)

// FileTier is the L2 tier on a (local or shared) file system:
// <root>/<namespace hex>/<key>.kvo, plus <root>/quarantine/ for files that
// failed verification.
//
// File safety (C9): directories are created 0700 and objects 0600. Every
// operation opens the root by its path (refusing a symlink as its last
// element, a root owned by another uid or writable by group or others),
// then works beneath it with openat: the namespace directory is opened
// O_DIRECTORY|O_NOFOLLOW and files O_NOFOLLOW, so a symlink planted in the
// tier is never followed. Renames, removals and fsyncs use the directory
// descriptors. Because nothing is cached but the root's path, the tier
// heals by itself when its directory is removed and put back: missing
// namespace and quarantine directories are created again (beneath the
// root, durably) on the next write.
type FileTier struct {
	root string
	// key MACs every header written and verifies every header read (C12);
	// nil: no MAC written or checked (insecure).
	key *MACKey

	// obs, when set (tests only), sees every change Put makes to the file
	// system, in order, and can stop it at a simulated power cut; ab
	// removes one of Put's durability steps (tests only: they prove the
	// power-cut test sees each missing step).
	obs fsObserver
	ab  l2Ablation
}

// fsObserver sees, in order, the changes FileTier makes: the power-cut
// model of the tests. dir is a directory path under the root. An error
// means the machine lost power at that point: the operation did not
// happen, and Put fails.
type fsObserver interface {
	created(dir, name string) error // opened O_CREAT (a new file, or an existing one truncated)
	wrote(dir, name string, p []byte) error
	synced(dir, name string) error // fsync of the file
	renamed(dir, from, to string) error
	dirSynced(dir string) error
	mkdir(parent, name string) error
}

// l2Ablation removes a durability step of Put (tests only).
type l2Ablation struct {
	noFileSync bool // skip the fsync of the object file
	noDirSync  bool // skip the fsync of directories after a rename or mkdir
	noRename   bool // write the final name in place instead of temp + rename
}

func (t *FileTier) observe(f func(fsObserver) error) error {
	if t.obs == nil {
		return nil
	}
	return f(t.obs)
}

// The durability steps of Put go through these helpers only, each telling
// the observer and doing the system call together, so a step removed from
// Put is missing from the power-cut model too.

func (t *FileTier) fsyncFile(dir, name string, f *os.File) error {
	if err := t.observe(func(o fsObserver) error { return o.synced(dir, name) }); err != nil {
		return err
	}
	return f.Sync()
}

func (t *FileTier) fsyncDir(dir string, fd int) error {
	if err := t.observe(func(o fsObserver) error { return o.dirSynced(dir) }); err != nil {
		return err
	}
	return syscall.Fsync(fd)
}

func (t *FileTier) renameIn(dir string, fd int, from, to string) error {
	if err := t.observe(func(o fsObserver) error { return o.renamed(dir, from, to) }); err != nil {
		return err
	}
	return syscall.Renameat(fd, from, fd, to)
}

// Modes of what the tier creates.
const (
	l2DirMode  = 0o700
	l2FileMode = 0o600
)

// OpenFileTier opens the file tier rooted at root, creating the root
// (0700, with its parents) when missing, and checks its safety rules.
// key is the cluster's storage MAC key: headers are written with its MAC
// and a header read (Get, Stat, Scan) whose MAC does not verify is
// unverified (ErrUnverified). A nil key writes zero MACs and checks none:
// whoever can write the root can then make a scan announce any sum.
func OpenFileTier(root string, key *MACKey) (*FileTier, error) {
	if root == "" {
		return nil, fmt.Errorf("L2 root is empty: %w", ErrConfig)
	}
	if err := mkdirAllDurable(root, l2DirMode); err != nil {
		return nil, fmt.Errorf("create L2 root %s: %w", root, errors.Join(err, ErrIO))
	}
	t := &FileTier{root: filepath.Clean(root), key: key}
	fd, err := t.openRoot()
	if err != nil {
		return nil, err
	}
	defer syscall.Close(fd)
	qfd, err := t.openDir(fd, QuarantineDir, true)
	if err != nil {
		return nil, fmt.Errorf("create L2 quarantine directory: %w", err)
	}
	syscall.Close(qfd)
	return t, nil
}

// mkdirAllDurable is os.MkdirAll, then an fsync of the parent of each
// directory it created: without it a power cut can lose a new root's name
// and every object acknowledged in it.
func mkdirAllDurable(dir string, mode os.FileMode) error {
	var made []string // directories missing before, innermost first
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) || filepath.Dir(d) == d {
			break
		}
		made = append(made, d)
	}
	if err := os.MkdirAll(dir, mode); err != nil {
		return err
	}
	for _, d := range made {
		p, err := os.Open(filepath.Dir(d))
		if err != nil {
			return err
		}
		err = p.Sync()
		p.Close()
		if err != nil {
			return fmt.Errorf("fsync %s: %w", filepath.Dir(d), err)
		}
	}
	return nil
}

// Check implements L2Checker: the root is there and passes the safety
// rules.
func (t *FileTier) Check() error {
	fd, err := t.openRoot()
	if err != nil {
		return err
	}
	return syscall.Close(fd)
}

// Root returns the tier's root directory.
func (t *FileTier) Root() string { return t.root }

// Path returns the file of key.
func (t *FileTier) Path(key dcp.Key) string {
	return filepath.Join(t.root, key.NS.String(), key.String()+FileExt)
}

func objName(key dcp.Key) string { return key.String() + FileExt }

// openRoot opens the root directory without following a symlink at its
// last element and checks that it belongs to this process's uid and is
// not writable by group or others.
func (t *FileTier) openRoot() (int, error) {
	fd, err := syscall.Open(t.root, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.ENOTDIR) {
			return -1, fmt.Errorf("L2 root %s is a symlink or not a directory: %w", t.root, errors.Join(ErrUnsafe, ErrIO))
		}
		return -1, fmt.Errorf("open L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		syscall.Close(fd)
		return -1, fmt.Errorf("stat L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	switch uid := os.Geteuid(); {
	case int(st.Uid) != uid:
		err = fmt.Errorf("L2 root %s is owned by uid %d, this process runs as uid %d: %w", t.root, st.Uid, uid, errors.Join(ErrUnsafe, ErrIO))
	case st.Mode&0o022 != 0:
		err = fmt.Errorf("L2 root %s has mode %#o: writable by group or others: %w", t.root, st.Mode&0o7777, errors.Join(ErrUnsafe, ErrIO))
	}
	if err != nil {
		syscall.Close(fd)
		return -1, err
	}
	return fd, nil
}

// openDir opens the directory name beneath dirfd without following a
// symlink, creating it (0700, then fsyncing dirfd) when create is set.
func (t *FileTier) openDir(dirfd int, name string, create bool) (int, error) {
	return t.openDirAt(dirfd, t.root, name, create)
}

func (t *FileTier) openDirAt(dirfd int, parent, name string, create bool) (int, error) {
	for attempt := 0; ; attempt++ {
		fd, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
		switch {
		case err == nil:
			return fd, nil
		case errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.ENOTDIR):
			return -1, fmt.Errorf("%s/%s is a symlink or not a directory: %w", t.root, name, errors.Join(ErrUnsafe, ErrIO))
		case errors.Is(err, syscall.ENOENT) && create && attempt == 0:
			if err := t.observe(func(o fsObserver) error { return o.mkdir(parent, name) }); err != nil {
				return -1, err
			}
			if err := syscall.Mkdirat(dirfd, name, l2DirMode); err != nil && !errors.Is(err, syscall.EEXIST) {
				return -1, fmt.Errorf("create %s/%s: %w", parent, name, errors.Join(err, ErrIO))
			}
			if !t.ab.noDirSync {
				if err := t.fsyncDir(parent, dirfd); err != nil {
					return -1, fmt.Errorf("fsync %s after creating %s: %w", parent, name, errors.Join(err, ErrIO))
				}
			}
			continue
		case errors.Is(err, syscall.ENOENT):
			return -1, fmt.Errorf("%s/%s: %w", t.root, name, errors.Join(err, fs.ErrNotExist))
		default:
			return -1, fmt.Errorf("open %s/%s: %w", t.root, name, errors.Join(err, ErrIO))
		}
	}
}

// openNS opens the namespace directory of ns beneath the root.
func (t *FileTier) openNS(ns dcp.Namespace, create bool) (int, error) {
	rfd, err := t.openRoot()
	if err != nil {
		return -1, err
	}
	defer syscall.Close(rfd)
	return t.openDir(rfd, ns.String(), create)
}

// openObj opens name beneath dirfd for reading: no symlink, no FIFO
// (O_NONBLOCK, so one cannot hang the open), only a regular file.
func openObj(dirfd int, dir, name string) (*os.File, error) {
	fd, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s/%s is a symlink: %w", dir, name, ErrUnsafe)
		}
		return nil, &fs.PathError{Op: "open", Path: dir + "/" + name, Err: err}
	}
	f := os.NewFile(uintptr(fd), dir+"/"+name)
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s/%s is not a regular file (mode %s): %w", dir, name, fi.Mode(), ErrUnsafe)
	}
	return f, nil
}

func tmpName(key dcp.Key, w wire.Rank) string {
	var r [6]byte
	_, _ = rand.Read(r[:])
	return TmpPrefix + key.String() + "." + w.Instance + "-" + strconv.Itoa(w.TPRank) + "." + hex.EncodeToString(r[:])
}

// Put implements L2Tier: temp file, write, fsync, rename, fsync directory.
func (t *FileTier) Put(ctx context.Context, obj L2Object, payload []byte) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	if uint64(len(payload)) != obj.Size {
		return fmt.Errorf("put %s: payload %d B, header says %d B: %w", obj.Key, len(payload), obj.Size, ErrIO)
	}
	if wire.ValidInstance(obj.Writer.Instance) != nil {
		return fmt.Errorf("put %s: writer instance %q invalid: %w", obj.Key, obj.Writer.Instance, ErrIO)
	}
	ioErr := func(step string, e error) error {
		return fmt.Errorf("put %s: %s: %w", obj.Key, step, errors.Join(e, ErrIO))
	}
	dfd, err := t.openNS(obj.Key.NS, true)
	if err != nil {
		return ioErr("namespace directory", err)
	}
	defer syscall.Close(dfd)
	dir := filepath.Join(t.root, obj.Key.NS.String())
	tmp, flags := tmpName(obj.Key, obj.Writer), syscall.O_EXCL
	if t.ab.noRename {
		tmp, flags = objName(obj.Key), syscall.O_TRUNC
	}
	if err := t.observe(func(o fsObserver) error { return o.created(dir, tmp) }); err != nil {
		return ioErr("power cut", err)
	}
	fd, err := syscall.Openat(dfd, tmp, syscall.O_WRONLY|syscall.O_CREAT|flags|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, l2FileMode)
	if err != nil {
		return ioErr("create temp file "+tmp, err)
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, tmp))
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = syscall.Unlinkat(dfd, tmp)
		}
	}()
	write := func(what string, p []byte) error {
		if err := t.observe(func(o fsObserver) error { return o.wrote(dir, tmp, p) }); err != nil {
			return ioErr("power cut", err)
		}
		if _, err := f.Write(p); err != nil {
			return ioErr(what, err)
		}
		return nil
	}
	// 1. The whole object into a temporary name.
	if err = write("write header", encodeHeader(obj, t.key)); err != nil {
		return err
	}
	if err = write("write payload", payload); err != nil {
		return err
	}
	// 2. Its bytes durable before any name points at them.
	if !t.ab.noFileSync {
		if err = t.fsyncFile(dir, tmp, f); err != nil {
			return ioErr("fsync", err)
		}
	}
	if err = f.Close(); err != nil {
		return ioErr("close", err)
	}
	// 3. The name switches atomically from the old object to the new one.
	if !t.ab.noRename {
		if err = t.renameIn(dir, dfd, tmp, objName(obj.Key)); err != nil {
			return ioErr("rename", err)
		}
	}
	// 4. The new name durable: only now is the object acknowledged (C6).
	if !t.ab.noDirSync {
		if err = t.fsyncDir(dir, dfd); err != nil {
			return ioErr("fsync directory", err)
		}
	}
	return nil
}

// open opens key's file for reading; a missing one gives ErrNotFound, an
// unsafe one (symlink, not regular) an error wrapping ErrUnsafe.
func (t *FileTier) open(key dcp.Key) (*os.File, int, error) {
	dfd, err := t.openNS(key.NS, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, -1, fmt.Errorf("L2 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return nil, -1, fmt.Errorf("open L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	f, err := openObj(dfd, filepath.Join(t.root, key.NS.String()), objName(key))
	if errors.Is(err, fs.ErrNotExist) {
		syscall.Close(dfd)
		return nil, -1, fmt.Errorf("L2 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return nil, dfd, err
	}
	return f, dfd, nil
}

// Get implements L2Tier.
func (t *FileTier) Get(ctx context.Context, key dcp.Key, fp [32]byte, dst []byte) (L2Object, error) {
	if err := ctx.Err(); err != nil {
		return L2Object{}, err
	}
	path := t.Path(key)
	f, dfd, err := t.open(key)
	if errors.Is(err, ErrUnsafe) {
		defer syscall.Close(dfd)
		return L2Object{}, t.corruptAt(dfd, key, L2Object{}, false, path, err.Error())
	}
	if err != nil {
		return L2Object{}, err
	}
	defer syscall.Close(dfd)
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return L2Object{}, fmt.Errorf("stat L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	o, h, err := readHeader(f, st.Size(), t.key)
	if err != nil {
		return o, markUnverified(t.corruptAt(dfd, key, o, h > 0, path, err.Error()), err)
	}
	switch {
	case o.Key != key:
		return o, t.corruptAt(dfd, key, o, true, path, "header names key "+o.Key.String())
	case o.Fingerprint != fp:
		return o, t.corruptAt(dfd, key, o, true, path, fmt.Sprintf("layout fingerprint %x, namespace has %x", o.Fingerprint[:8], fp[:8]))
	case o.Size != uint64(len(dst)):
		return o, t.corruptAt(dfd, key, o, true, path, fmt.Sprintf("payload %d B, the geometry says %d B", o.Size, len(dst)))
	}
	if _, err := f.ReadAt(dst, int64(h)); err != nil {
		return o, fmt.Errorf("read L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	if sum := checksum.Sum(dst); sum != o.Sum {
		return o, t.corruptAt(dfd, key, o, true, path, fmt.Sprintf("payload kvsum64 %016x, recorded %016x", sum, o.Sum))
	}
	return o, nil
}

// Stat implements L2Tier.
func (t *FileTier) Stat(ctx context.Context, key dcp.Key) (L2Object, error) {
	if err := ctx.Err(); err != nil {
		return L2Object{}, err
	}
	f, dfd, err := t.open(key)
	if errors.Is(err, ErrUnsafe) {
		syscall.Close(dfd)
		return L2Object{}, fmt.Errorf("L2 object %s: %w: %w", key, err, ErrCorrupt)
	}
	if err != nil {
		return L2Object{}, err
	}
	defer syscall.Close(dfd)
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return L2Object{}, fmt.Errorf("stat L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	o, _, err := readHeader(f, st.Size(), t.key)
	if err == nil && o.Key != key {
		err = fmt.Errorf("header names key %s", o.Key)
	}
	if errors.Is(err, ErrUnverified) {
		return o, fmt.Errorf("L2 object %s: %w: %w", key, err, ErrCorrupt)
	}
	if err != nil {
		return o, fmt.Errorf("L2 object %s: %s: %w", key, err, ErrCorrupt)
	}
	return o, nil
}

// corruptAt quarantines name (key's file in the directory dirfd) and
// returns the *CorruptError describing it.
func (t *FileTier) corruptAt(dirfd int, key dcp.Key, o L2Object, writerKnown bool, path, why string) error {
	ce := &CorruptError{Key: key, Writer: o.Writer, WriterKnown: writerKnown, Path: path, Reason: why}
	if q, err := t.moveAside(dirfd, filepath.Base(path), why); err == nil {
		ce.Quarantine = q
	}
	return ce
}

// markUnverified sets Unverified on the *CorruptError err when its cause
// was a header MAC that failed; it returns err.
func markUnverified(err, cause error) error {
	var ce *CorruptError
	if errors.Is(cause, ErrUnverified) && errors.As(err, &ce) {
		ce.Unverified = true
	}
	return err
}

// moveAside renames name of dirfd into the quarantine directory (created
// again beneath the root if it is missing), with the reason beside it.
func (t *FileTier) moveAside(dirfd int, name, why string) (string, error) {
	rfd, err := t.openRoot()
	if err != nil {
		return "", err
	}
	defer syscall.Close(rfd)
	qfd, err := t.openDir(rfd, QuarantineDir, true)
	if err != nil {
		return "", err
	}
	defer syscall.Close(qfd)
	var r [4]byte
	_, _ = rand.Read(r[:])
	qname := name + "." + strconv.FormatInt(time.Now().UnixNano(), 10) + "." + hex.EncodeToString(r[:])
	if err := syscall.Renameat(dirfd, name, qfd, qname); err != nil {
		return "", &fs.PathError{Op: "quarantine", Path: name, Err: err}
	}
	// The reason travels beside the file for the operator; best effort.
	if fd, err := syscall.Openat(qfd, qname+".why", syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, l2FileMode); err == nil {
		_, _ = syscall.Write(fd, []byte(why+"\n"))
		syscall.Close(fd)
	}
	_ = syscall.Fsync(qfd)
	_ = syscall.Fsync(dirfd)
	return filepath.Join(t.root, QuarantineDir, qname), nil
}

// Delete implements L2Tier.
func (t *FileTier) Delete(ctx context.Context, key dcp.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dfd, err := t.openNS(key.NS, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	defer syscall.Close(dfd)
	if err := syscall.Unlinkat(dfd, objName(key)); err != nil && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("delete L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	if err := syscall.Fsync(dfd); err != nil {
		return fmt.Errorf("delete L2 object %s: fsync directory: %w", key, errors.Join(err, ErrIO))
	}
	return nil
}

// Quarantine implements L2Tier.
func (t *FileTier) Quarantine(ctx context.Context, key dcp.Key, why string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dfd, err := t.openNS(key.NS, false)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("quarantine L2 object %s: %w", key, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("quarantine L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	defer syscall.Close(dfd)
	if _, err := t.moveAside(dfd, objName(key), why); err != nil {
		if errors.Is(err, syscall.ENOENT) {
			return fmt.Errorf("quarantine L2 object %s: %w", key, ErrNotFound)
		}
		return fmt.Errorf("quarantine L2 object %s: %w", key, errors.Join(err, ErrIO))
	}
	return nil
}

// readDirFD lists the directory dirfd (which stays open).
func readDirFD(dirfd int, name string) ([]fs.DirEntry, error) {
	dup, err := syscall.Dup(dirfd)
	if err != nil {
		return nil, err
	}
	d := os.NewFile(uintptr(dup), name)
	defer d.Close()
	return d.ReadDir(-1)
}

// Scan implements L2Tier. Files of other writers with readable headers are
// skipped (their writers verify them; every Get verifies anyway). Entries
// that are not regular files (FIFOs, devices, symlinks) and namespace
// directories that are symlinks are reported Skipped and never opened as
// objects.
func (t *FileTier) Scan(ctx context.Context, owner wire.Rank, verify bool, fn func(ScanEntry)) error {
	rfd, err := t.openRoot()
	if err != nil {
		return fmt.Errorf("scan L2 root: %w", err)
	}
	defer syscall.Close(rfd)
	nsDirs, err := readDirFD(rfd, t.root)
	if err != nil {
		return fmt.Errorf("scan L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	myTmp := "." + owner.Instance + "-" + strconv.Itoa(owner.TPRank) + "."
	buf := make([]byte, 1<<20)
	for _, d := range nsDirs {
		ns, err := dcp.ParseNamespace(d.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join(t.root, d.Name())
		if !d.IsDir() {
			if d.Type()&fs.ModeSymlink != 0 {
				fn(ScanEntry{Skipped: dir + " is a symlink where a namespace directory belongs"})
			}
			continue
		}
		dfd, err := t.openDir(rfd, d.Name(), false)
		if errors.Is(err, ErrUnsafe) {
			fn(ScanEntry{Skipped: err.Error()})
			continue
		}
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("scan L2 directory %s: %w", dir, err)
		}
		err = t.scanNS(ctx, dfd, dir, ns, owner, myTmp, verify, buf, fn)
		syscall.Close(dfd)
		if err != nil {
			return err
		}
	}
	return nil
}

func (t *FileTier) scanNS(ctx context.Context, dfd int, dir string, ns dcp.Namespace, owner wire.Rank, myTmp string,
	verify bool, buf []byte, fn func(ScanEntry)) error {
	files, err := readDirFD(dfd, dir)
	if err != nil {
		return fmt.Errorf("scan L2 directory %s: %w", dir, errors.Join(err, ErrIO))
	}
	for _, fe := range files {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := fe.Name()
		if !fe.Type().IsRegular() {
			if !fe.IsDir() {
				fn(ScanEntry{Skipped: fmt.Sprintf("%s/%s is not a regular file (type %s)", dir, name, fe.Type())})
			}
			continue
		}
		if strings.HasPrefix(name, TmpPrefix) {
			if strings.Contains(name, myTmp) {
				_ = syscall.Unlinkat(dfd, name) // an interrupted write of ours
			}
			continue
		}
		if !strings.HasSuffix(name, FileExt) {
			continue
		}
		key, kerr := dcp.ParseKey(strings.TrimSuffix(name, FileExt))
		if kerr != nil || key.NS != ns {
			continue // not an object file of ours to judge
		}
		if e := t.scanFile(dfd, dir, name, key, owner, verify, buf); e != nil {
			fn(*e)
		}
	}
	return nil
}

// scanFile checks one file; nil means it is another writer's and was
// skipped (or vanished).
func (t *FileTier) scanFile(dfd int, dir, name string, key dcp.Key, owner wire.Rank, verify bool, buf []byte) *ScanEntry {
	path := filepath.Join(dir, name)
	bad := func(o L2Object, writerKnown bool, why string) *ScanEntry {
		o.Key = key
		return &ScanEntry{Object: o, KeyKnown: true, WriterKnown: writerKnown,
			Err: t.corruptAt(dfd, key, o, writerKnown, path, why)}
	}
	// An unverified object (its MAC fails: C12) is quarantined like a
	// corrupt one and never announced; ScanEntry.Err says ErrUnverified.
	badErr := func(o L2Object, writerKnown bool, err error) *ScanEntry {
		e := bad(o, writerKnown, err.Error())
		markUnverified(e.Err, err)
		return e
	}
	f, err := openObj(dfd, dir, name)
	if errors.Is(err, ErrUnsafe) {
		return &ScanEntry{Skipped: err.Error()} // swapped for a non-regular file since the listing
	}
	if err != nil {
		return nil // vanished (deleted or quarantined by another rank)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	o, h, err := readHeader(f, st.Size(), t.key)
	if err != nil && h == 0 {
		// Unreadable header: the writer is unknown. Only the shard's writer
		// quarantines it (writer TP rank = shard, see dcp.StoreShard), so
		// ranks sharing the root do not race over it.
		if int(key.Shard) != owner.TPRank {
			return nil
		}
		return bad(o, false, err.Error())
	}
	if o.Writer != owner {
		return nil
	}
	if err != nil {
		return badErr(o, true, err)
	}
	if o.Key != key {
		return bad(o, true, "header names key "+o.Key.String())
	}
	if verify {
		var d checksum.Digest
		if _, err := io.CopyBuffer(&d, io.NewSectionReader(f, int64(h), int64(o.Size)), buf); err != nil {
			return bad(o, true, "read payload: "+err.Error())
		}
		if d.Len() != o.Size {
			return bad(o, true, fmt.Sprintf("payload %d B, recorded %d B", d.Len(), o.Size))
		}
		if sum := d.Sum64(); sum != o.Sum {
			return bad(o, true, fmt.Sprintf("payload kvsum64 %016x, recorded %016x", sum, o.Sum))
		}
	}
	return &ScanEntry{Object: o, KeyKnown: true, WriterKnown: true}
}

// FreeBytes returns the bytes available to this user on the file system
// of the tier's root (statfs).
func (t *FileTier) FreeBytes() (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(t.root, &st); err != nil {
		return 0, fmt.Errorf("statfs of L2 root %s: %w", t.root, errors.Join(err, ErrIO))
	}
	return st.Bavail * uint64(st.Bsize), nil
}
