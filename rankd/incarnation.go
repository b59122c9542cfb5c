package rankd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvtier/kvtier/cluster"
	"github.com/kvtier/kvtier/wire"
)

// nextIncarnation returns this start's incarnation and stores it: see
// peekIncarnation and saveIncarnation.
func nextIncarnation(l2Dir string, r wire.Rank) (uint64, error) {
	inc, err := peekIncarnation(l2Dir, r)
	if err != nil {
		return 0, err
	}
	if err := saveIncarnation(l2Dir, r, inc); err != nil {
		return 0, err
	}
	return inc, nil
}

func incarnationPath(l2Dir string, r wire.Rank) (dir, path string) {
	dir = filepath.Join(l2Dir, "incarnations")
	return dir, filepath.Join(dir, r.Instance+"."+strconv.Itoa(r.TPRank))
}

// storedIncarnation reads the last incarnation kept for r (0 when none).
func storedIncarnation(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		last, perr := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if perr != nil {
			return 0, fmt.Errorf("incarnation file %s holds %q, not a number: %w", path, b, ErrConfig)
		}
		return last, nil
	case errors.Is(err, os.ErrNotExist):
		return 0, nil
	default:
		return 0, fmt.Errorf("read incarnation file: %w", err)
	}
}

// peekIncarnation returns this start's incarnation, writing nothing:
// larger than every earlier one of the rank even when the wall clock
// stepped back (an NTP step, a rank moved to a host whose clock is
// behind), which would otherwise make the coordinator drop every batch as
// from a superseded incarnation (C7). With an L2 directory the last
// incarnation is kept in <l2>/incarnations/<instance>.<tp>
// (saveIncarnation); without one the clock alone decides.
func peekIncarnation(l2Dir string, r wire.Rank) (uint64, error) {
	inc := cluster.NewIncarnation()
	if l2Dir == "" {
		return inc, nil
	}
	_, path := incarnationPath(l2Dir, r)
	last, err := storedIncarnation(path)
	if err != nil {
		return 0, err
	}
	if last >= inc {
		inc = last + 1
	}
	return inc, nil
}

// saveIncarnation stores inc as r's last incarnation, durably (temp,
// fsync, rename, directory fsync), before it is used. It refuses when the
// stored one is already >= inc: another start of the rank stored its own
// since peekIncarnation.
func saveIncarnation(l2Dir string, r wire.Rank, inc uint64) error {
	if l2Dir == "" {
		return nil
	}
	dir, path := incarnationPath(l2Dir, r)
	last, err := storedIncarnation(path)
	if err != nil {
		return err
	}
	if last >= inc {
		return fmt.Errorf("incarnation file %s holds %d, not below this start's %d: another start of rank %s stored its incarnation meanwhile: %w",
			path, last, inc, r, ErrDuplicateRank)
	}
	_, statErr := os.Stat(dir)
	if err := os.MkdirAll(dir, 0o700); err != nil { // private, like the L2 tier (C9)
		return fmt.Errorf("incarnation directory: %w", err)
	}
	if errors.Is(statErr, os.ErrNotExist) { // its name is durable once the L2 root is fsynced
		var d *os.File
		if d, err = os.Open(l2Dir); err == nil {
			err = d.Sync()
			d.Close()
		}
		if err != nil {
			return fmt.Errorf("incarnation directory: fsync %s: %w", l2Dir, err)
		}
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("write incarnation file: %w", err)
	}
	_, err = f.WriteString(strconv.FormatUint(inc, 10) + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		var d *os.File
		if d, err = os.Open(dir); err == nil {
			err = d.Sync()
			d.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("write incarnation file %s: %w", path, err)
	}
	return nil
}
