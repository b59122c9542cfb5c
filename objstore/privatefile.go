package objstore

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// readOwnFile reads a file a daemon was configured with, as auth loads
// seed files (C9: the files a daemon opens are its own): opened without
// following a symlink and without blocking (a FIFO planted at the path
// would hold the open until a writer came, so rankd would hang at start),
// then fstat'ed: a regular file of at most max bytes, owned by this
// process's user or root. With secret set, no group or other permission
// bit may be set; otherwise (a CA bundle, which decides whom the store
// trusts) no group or other write bit. Errors name what and the path.
func readOwnFile(what, path string, secret bool, max int64) ([]byte, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("objstore: %s %s "+format+": %w", append([]any{what, path}, append(args, ErrConfig)...)...)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscallNoFollow|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, bad("is a symlink (symlinks are refused): %w", err)
		}
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("objstore: %s %s: %w", what, path, errors.Join(err, ErrConfig))
		}
		return nil, fmt.Errorf("objstore: %s: %w", what, errors.Join(err, ErrConfig))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("objstore: %s: %w", what, errors.Join(err, ErrConfig))
	}
	if !st.Mode().IsRegular() {
		return nil, bad("is not a regular file (mode %s)", st.Mode())
	}
	m := st.Mode().Perm()
	switch {
	case secret && m&0o077 != 0:
		return nil, bad("has mode %04o: want no access by group or others (chmod 600)", m)
	case !secret && m&0o022 != 0:
		return nil, bad("has mode %04o: others could write it (chmod 644)", m)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() && sys.Uid != 0 {
		return nil, bad("is owned by uid %d, neither this process's uid %d nor root", sys.Uid, os.Geteuid())
	}
	if st.Size() > max {
		return nil, bad("is %d B, over %d B", st.Size(), max)
	}
	// Regular files ignore O_NONBLOCK; read one byte past max so a file
	// that grew since the fstat is refused rather than cut.
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, fmt.Errorf("objstore: %s: %w", what, errors.Join(err, ErrConfig))
	}
	if int64(len(b)) > max {
		return nil, bad("grew over %d B while read", max)
	}
	return b, nil
}
