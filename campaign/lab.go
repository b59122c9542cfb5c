package campaign

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
)

// lab is a bridge in the root network namespace and one namespace per
// rank joined to it by a veth pair. The coordinator and the NATS proxies
// listen on the bridge address.
type lab struct {
	suffix string
	bridge string
	subnet string
	ns     []string
	vethH  []string // root-side end of each rank's veth

	// mu guards the following.
	mu       sync.Mutex
	parts    []int  // partitions in force per rank
	flapDown []bool // a lossy link's current down phase per rank
	down     []bool // the link's applied state
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newLab builds the namespaces, or says why it cannot (not root, no ip).
func newLab(ranks int) (*lab, error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("not root (euid %d): network namespaces need CAP_SYS_ADMIN", os.Geteuid())
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("the ip command is not installed: %w", err)
	}
	l := &lab{suffix: fmt.Sprintf("%03d%d", os.Getpid()%1000, rand.IntN(10)),
		parts: make([]int, ranks), flapDown: make([]bool, ranks), down: make([]bool, ranks)}
	l.bridge = "kcbr" + l.suffix
	l.subnet = fmt.Sprintf("10.232.%d", 1+rand.IntN(250))
	ok := false
	defer func() {
		if !ok {
			l.teardown()
		}
	}()
	if err := ipCmd("link", "add", l.bridge, "type", "bridge"); err != nil {
		return nil, err
	}
	for _, a := range [][]string{{"addr", "add", l.subnet + ".1/24", "dev", l.bridge}, {"link", "set", l.bridge, "up"}} {
		if err := ipCmd(a...); err != nil {
			return nil, err
		}
	}
	for r := range ranks {
		ns := fmt.Sprintf("kcns%s%d", l.suffix, r)
		h, c := fmt.Sprintf("kch%s%d", l.suffix, r), fmt.Sprintf("kcn%s%d", l.suffix, r)
		if err := ipCmd("netns", "add", ns); err != nil {
			return nil, err
		}
		l.ns = append(l.ns, ns)
		if err := ipCmd("link", "add", h, "type", "veth", "peer", "name", c); err != nil {
			return nil, err
		}
		l.vethH = append(l.vethH, h)
		for _, a := range [][]string{{"link", "set", h, "master", l.bridge}, {"link", "set", h, "up"},
			{"link", "set", c, "netns", ns}, {"-n", ns, "addr", "add", l.rankIP(r) + "/24", "dev", c},
			{"-n", ns, "link", "set", c, "up"}, {"-n", ns, "link", "set", "lo", "up"}} {
			if err := ipCmd(a...); err != nil {
				return nil, err
			}
		}
	}
	ok = true
	return l, nil
}

func (l *lab) rankIP(r int) string { return fmt.Sprintf("%s.%d", l.subnet, 10+r) }
func (l *lab) hostIP() string      { return l.subnet + ".1" }
func (l *lab) wrap(r int) []string { return []string{"ip", "netns", "exec", l.ns[r]} }

// partition adds (+1) or removes (-1) a partition of rank r.
func (l *lab) partition(r, delta int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.parts[r] = max(0, l.parts[r]+delta)
	return l.applyLocked(r)
}

// flap sets the down phase of rank r's lossy link.
func (l *lab) flap(r int, down bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.flapDown[r] = down
	return l.applyLocked(r)
}

func (l *lab) applyLocked(r int) error {
	want := l.parts[r] > 0 || l.flapDown[r]
	if want == l.down[r] {
		return nil
	}
	state := "up"
	if want {
		state = "down"
	}
	if err := ipCmd("link", "set", l.vethH[r], state); err != nil {
		return err
	}
	l.down[r] = want
	return nil
}

// healAll brings every link up.
func (l *lab) healAll() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var first error
	for r := range l.parts {
		l.parts[r], l.flapDown[r] = 0, false
		if err := l.applyLocked(r); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (l *lab) teardown() {
	for _, h := range l.vethH {
		_ = ipCmd("link", "del", h)
	}
	for _, ns := range l.ns {
		_ = ipCmd("netns", "del", ns)
	}
	_ = ipCmd("link", "del", l.bridge)
}

// mountTmpfs mounts a tmpfs of size bytes at dir (mode 0700), or says why
// it cannot.
func mountTmpfs(dir string, size int64) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("not root (euid %d): mounting a tmpfs needs CAP_SYS_ADMIN", os.Geteuid())
	}
	out, err := exec.Command("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d,mode=0700", size), "tmpfs", dir).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mount tmpfs at %s: %w: %s", dir, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func unmount(dir string) {
	_ = exec.Command("umount", "-l", dir).Run()
}
