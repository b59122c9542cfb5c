package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvtier/kvtier/internal/flagfile"
)

// unit is a systemd unit file: section -> key -> values (a key may repeat).
type unit map[string]map[string][]string

func readUnit(t *testing.T, path string) unit {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	u := unit{}
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[' && line[len(line)-1] == ']':
			section = line[1 : len(line)-1]
			u[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("%s:%d: %q is not key=value inside a section", path, n, line)
			}
			u[section][k] = append(u[section][k], v)
		}
	}
	return u
}

func (u unit) one(t *testing.T, section, key string) string {
	t.Helper()
	vs := u[section][key]
	if len(vs) != 1 {
		t.Fatalf("[%s] %s: %d values %q, want one", section, key, len(vs), vs)
	}
	return vs[0]
}

// exampleSettings reads an example config as flagfile reads it.
func exampleSettings(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := flagfile.ParseSettings(data)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	m := map[string]string{}
	for _, x := range s {
		m[x.Key] = x.Value
	}
	return m
}

// writable reports whether dir is inside one of the unit's ReadWritePaths.
func writable(u unit, dir string) bool {
	for _, v := range u["Service"]["ReadWritePaths"] {
		for _, p := range strings.Fields(v) {
			p = strings.TrimLeft(p, "-+")
			if rel, err := filepath.Rel(p, dir); err == nil && !strings.HasPrefix(rel, "..") {
				return true
			}
		}
	}
	return false
}

// TestUnits: the units run the daemons as an unprivileged user, hardened,
// from the config files the examples are written for, with the example
// configs' data and L2 directories writable and pinned memory unlimited.
func TestUnits(t *testing.T) {
	for _, tc := range []struct {
		file, bin, conf, example, dirKey string
		// optional directories the daemon writes, commented out in the
		// example: each must be writable under the unit once uncommented
		optDirKeys []string
	}{
		{"systemd/kvtier-coordinator.service", "/usr/local/bin/coordinator", "/etc/kvtier/coordinator.conf", "examples/coordinator.conf", "data-dir", []string{"raft-dir"}},
		{"systemd/kvtier-rankd@.service", "/usr/local/bin/rankd", "/etc/kvtier/rankd-%i.conf", "examples/rankd.conf", "l2-dir", []string{"host-l1-dir"}},
	} {
		u := readUnit(t, tc.file)
		if user := u.one(t, "Service", "User"); user == "" || user == "root" || user == "0" {
			t.Errorf("%s: User=%q, want a dedicated user", tc.file, user)
		}
		for key, want := range map[string]string{"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "CapabilityBoundingSet": ""} {
			if got := u.one(t, "Service", key); got != want {
				t.Errorf("%s: %s=%q, want %q", tc.file, key, got, want)
			}
		}
		args := strings.Fields(u.one(t, "Service", "ExecStart"))
		if len(args) == 0 || args[0] != tc.bin {
			t.Errorf("%s: ExecStart %q does not run %s", tc.file, args, tc.bin)
		}
		conf := ""
		for i, a := range args {
			if (a == "--config" || a == "-config") && i+1 < len(args) {
				conf = args[i+1]
			}
		}
		if conf != tc.conf {
			t.Errorf("%s: --config %q, want %q", tc.file, conf, tc.conf)
		}
		ex := exampleSettings(t, tc.example)
		dir := ex[tc.dirKey]
		if dir == "" || !writable(u, dir) {
			t.Errorf("%s: %s %q of %s is not under ReadWritePaths %q", tc.file, tc.dirKey, dir, tc.example, u["Service"]["ReadWritePaths"])
		}
		all := exampleKeys(t, tc.example)
		for _, k := range tc.optDirKeys {
			if dir := all[k].value; dir == "" || !writable(u, dir) {
				t.Errorf("%s: %s %q of %s (line %d) is not under ReadWritePaths %q", tc.file, k, dir, tc.example, all[k].line, u["Service"]["ReadWritePaths"])
			}
		}
		if tc.dirKey == "l2-dir" {
			if got := u.one(t, "Service", "LimitMEMLOCK"); got != "infinity" {
				t.Errorf("%s: LimitMEMLOCK=%q: L1 (l1-bytes %s) is pinned memory; want infinity", tc.file, got, ex["l1-bytes"])
			}
		}
	}
}

// TestUnitsVerify runs systemd-analyze verify on the units: an unknown or
// misspelled directive is reported (the binaries' absence is not a fault
// of the units).
func TestUnitsVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed; TestUnits still checks the units")
	}
	dir := t.TempDir()
	var files []string
	for _, f := range []string{"kvtier-coordinator.service", "kvtier-rankd@.service"} {
		data, err := os.ReadFile(filepath.Join("systemd", f))
		if err != nil {
			t.Fatal(err)
		}
		name := strings.Replace(f, "@.", "@engine0-0.", 1)
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, filepath.Join(dir, name))
	}
	out, _ := exec.Command(sa, append([]string{"verify", "--man=no"}, files...)...).CombinedOutput()
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line != "" && !strings.Contains(line, "is not executable: No such file or directory") {
			t.Errorf("systemd-analyze: %s", line)
		}
	}
}
