package flagfile

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
)

// newSet is a flag set like a daemon's: strings, an int, a bool, a secret.
func newSet(out *bytes.Buffer) (*flag.FlagSet, map[string]any) {
	fs := flag.NewFlagSet("rankd", flag.ContinueOnError)
	fs.SetOutput(out)
	v := map[string]any{
		"instance":   fs.String("instance", "", ""),
		"l2-dir":     fs.String("l2-dir", "", ""),
		"tp-rank":    fs.Int("tp-rank", 0, ""),
		"insecure":   fs.Bool("insecure", false, ""),
		"gossip-key": fs.String("gossip-key", "", ""),
	}
	return fs, v
}

func writeConf(t *testing.T, text string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "rankd.conf")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestParseSettings(t *testing.T) {
	text := "# comment\n\n" +
		"instance = engine0\n" +
		"  l2-dir=/var/lib/kvtier/l2 # trailing comment\r\n" +
		`node-name = "a b # not a comment" # but this is` + "\n" +
		"empty =\n" +
		"hash = a#b\n" +
		"only-comment = # nothing\n" +
		`esc = "tab\there"` + "\n"
	got, err := ParseSettings([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	want := []Setting{
		{"instance", "engine0", 3},
		{"l2-dir", "/var/lib/kvtier/l2", 4},
		{"node-name", "a b # not a comment", 5},
		{"empty", "", 6},
		{"hash", "a#b", 7},
		{"only-comment", "", 8},
		{"esc", "tab\there", 9},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("settings:\n got %+v\nwant %+v", got, want)
	}
}

func TestParseSettingsErrors(t *testing.T) {
	for _, tc := range []struct {
		text, msg string
		is        error
	}{
		{"instance engine0\n", `line 1: "instance engine0" has no '=': want key = value: flagfile: syntax error`, ErrSyntax},
		{"\n= x\n", `line 2: empty key before '=': flagfile: syntax error`, ErrSyntax},
		{"--instance = x\n", `line 1: key "--instance": write the flag name without dashes: flagfile: syntax error`, ErrSyntax},
		{"in stance = x\n", `line 1: key "in stance": character ' ' is not allowed in a flag name: flagfile: syntax error`, ErrSyntax},
		{`a = "open` + "\n", `line 1: key "a": value "open is not a valid double-quoted string: flagfile: syntax error`, ErrSyntax},
		{`a = "x" y` + "\n", `line 1: key "a": text "y" after the quoted value: flagfile: syntax error`, ErrSyntax},
		{"a = 1\n# c\na = 2\n", `line 3: key "a" already set on line 1: flagfile: duplicate key`, ErrDuplicateKey},
	} {
		_, err := ParseSettings([]byte(tc.text))
		if err == nil || err.Error() != tc.msg || !errors.Is(err, tc.is) {
			t.Errorf("%q:\n got %v\nwant %s", tc.text, err, tc.msg)
		}
	}
}

// TestUnknownKeyNamesKeyAndLine: a typo in a key is refused, naming the
// file, the line and the key, and nothing after it is applied.
func TestUnknownKeyNamesKeyAndLine(t *testing.T) {
	var out bytes.Buffer
	fs, v := newSet(&out)
	p := writeConf(t, "instance = engine0\n\n# L2\nl2-dirs = /data/l2\ntp-rank = 3\n", 0o600)
	err := Parse(fs, []string{"--config", p})
	want := "config " + p + `:4: key "l2-dirs" is not a flag of rankd: flagfile: unknown key`
	if err == nil || err.Error() != want || !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("got %v\nwant %s", err, want)
	}
	if out.String() != want+"\n" {
		t.Fatalf("output %q, want the error line", out.String())
	}
	if *v["tp-rank"].(*int) != 0 {
		t.Fatalf("tp-rank %d applied after the bad line", *v["tp-rank"].(*int))
	}
}

// TestCommandLineWins: flags on the command line override the file,
// wherever --config stands among them.
func TestCommandLineWins(t *testing.T) {
	p := writeConf(t, "instance = fromfile\nl2-dir = /file/l2\ntp-rank = 2\ninsecure = true\n", 0o644)
	for _, args := range [][]string{
		{"--config", p, "--tp-rank", "5", "-instance=cli"},
		{"--tp-rank", "5", "-insecure", "-config=" + p, "--instance", "cli"},
		{"-instance", "cli", "--tp-rank=5", "--config=" + p, "rest"},
	} {
		var out bytes.Buffer
		fs, v := newSet(&out)
		if err := Parse(fs, args); err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		got := []any{*v["instance"].(*string), *v["l2-dir"].(*string), *v["tp-rank"].(*int), *v["insecure"].(*bool)}
		if want := []any{"cli", "/file/l2", 5, true}; !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: got %v, want %v", args, got, want)
		}
		if fs.Lookup(FlagName).Value.String() != p {
			t.Fatalf("%q: --config %q", args, fs.Lookup(FlagName).Value.String())
		}
	}
}

// TestNoConfig: without --config, Parse is flag.Parse (a config-like
// argument after the flags is not read).
func TestNoConfig(t *testing.T) {
	var out bytes.Buffer
	fs, v := newSet(&out)
	p := writeConf(t, "instance = fromfile\n", 0o600)
	if err := Parse(fs, []string{"--tp-rank", "1", "x", "--config", p}); err != nil {
		t.Fatal(err)
	}
	if *v["instance"].(*string) != "" || fs.NArg() != 3 {
		t.Fatalf("instance %q, args %q", *v["instance"].(*string), fs.Args())
	}
}

func TestRefusedSettings(t *testing.T) {
	for _, tc := range []struct {
		text, msg string
		is        error
	}{
		{"gossip-key = c2VjcmV0\n", `:1: key "gossip-key" holds a secret; give it on the command line or through its file flag: flagfile: secret in config file`, ErrSecret},
		{"instance = a\nconfig = /etc/other.conf\n", `:2: key "config": flagfile: config file names another config file`, ErrNested},
		{"tp-rank = three\n", `:1: key "tp-rank": value "three" refused: flagfile: invalid value: parse error`, ErrValue},
		{"insecure = maybe\n", `:1: key "insecure": value "maybe" refused: flagfile: invalid value: parse error`, ErrValue},
	} {
		var out bytes.Buffer
		fs, _ := newSet(&out)
		p := writeConf(t, tc.text, 0o600)
		err := Parse(fs, []string{"--config", p}, "gossip-key")
		if want := "config " + p + tc.msg; err == nil || err.Error() != want || !errors.Is(err, tc.is) {
			t.Errorf("%q:\n got %v\nwant %s", tc.text, err, want)
		}
	}
}

// TestUnsafeFiles: a file others may write, and a FIFO (which must not
// block the daemon), are refused.
func TestUnsafeFiles(t *testing.T) {
	var out bytes.Buffer
	fs, _ := newSet(&out)
	p := writeConf(t, "instance = a\n", 0o666)
	err := Parse(fs, []string{"--config", p})
	want := "config " + p + ": mode 0666 lets group or others write it (it decides which credentials the daemon loads); chmod go-w: flagfile: unsafe config file"
	if err == nil || err.Error() != want || !errors.Is(err, ErrUnsafeFile) {
		t.Fatalf("got %v\nwant %s", err, want)
	}

	fifo := filepath.Join(t.TempDir(), "fifo.conf")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	fs, _ = newSet(&out)
	err = Parse(fs, []string{"--config", fifo})
	if want := "config " + fifo + ": mode prw-------: not a regular file: flagfile: unsafe config file"; err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}

	fs, _ = newSet(&out)
	missing := filepath.Join(t.TempDir(), "none.conf")
	if err := Parse(fs, []string{"--config", missing}); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}

func TestCheckFile(t *testing.T) {
	for _, tc := range []struct {
		mode      os.FileMode
		size      int64
		uid, euid int
		msg       string
	}{
		{0o600, 10, 1000, 1000, ""},
		{0o644, 10, 0, 1000, ""},
		{0o640, 10, -1, 1000, ""},
		{0o620, 10, 1000, 1000, "mode 0620 lets group or others write it (it decides which credentials the daemon loads); chmod go-w: flagfile: unsafe config file"},
		{0o602, 10, 0, 0, "mode 0602 lets group or others write it (it decides which credentials the daemon loads); chmod go-w: flagfile: unsafe config file"},
		{0o644, 10, 1001, 1000, "owned by uid 1001, neither root nor this process's uid 1000: flagfile: unsafe config file"},
		{0o644, 10, 65534, 0, "owned by uid 65534, neither root nor this process's uid 0: flagfile: unsafe config file"},
		{os.ModeDir | 0o755, 10, 0, 0, "mode drwxr-xr-x: not a regular file: flagfile: unsafe config file"},
		{os.ModeSymlink | 0o777, 10, 0, 0, "mode Lrwxrwxrwx: not a regular file: flagfile: unsafe config file"},
		{0o600, MaxFileBytes + 1, 0, 0, "1048577 bytes exceeds the 1048576-byte limit: flagfile: unsafe config file"},
	} {
		err := CheckFile(tc.mode, tc.size, tc.uid, tc.euid)
		got := ""
		if err != nil {
			got = err.Error()
			if !errors.Is(err, ErrUnsafeFile) {
				t.Errorf("%v: %v does not wrap ErrUnsafeFile", tc.mode, err)
			}
		}
		if got != tc.msg {
			t.Errorf("%v uid %d euid %d:\n got %q\nwant %q", tc.mode, tc.uid, tc.euid, got, tc.msg)
		}
	}
}

// TestOwnerRefused chowns a real file when the test runs as root (the rule
// itself is TestCheckFile's).
func TestOwnerRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown; the rule is covered by TestCheckFile")
	}
	p := writeConf(t, "instance = a\n", 0o644)
	if err := os.Chown(p, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	fs, _ := newSet(&out)
	err := Parse(fs, []string{"--config", p})
	if want := "config " + p + ": owned by uid 65534, neither root nor this process's uid 0: flagfile: unsafe config file"; err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
}

func FuzzParseSettings(f *testing.F) {
	f.Add([]byte("a = b\n# c\nd = \"e f\" # g\n"))
	f.Add([]byte("=\n\"\n a = \"\\x\"\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseSettings(data)
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, x := range s {
			if x.Key == "" || strings.HasPrefix(x.Key, "-") || seen[x.Key] || x.Line < 1 {
				t.Fatalf("bad setting %+v from %q", x, data)
			}
			seen[x.Key] = true
		}
	})
}

// list is a flag.Value that accumulates, as a repeatable flag does.
type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(s string) error { *l = append(*l, s); return nil }

// TestOverriddenNotApplied: a flag the command line sets gets nothing from
// the file, so a repeatable flag holds the command line's values only.
func TestOverriddenNotApplied(t *testing.T) {
	var out bytes.Buffer
	fs, v := newSet(&out)
	var seeds list
	fs.Var(&seeds, "seed", "")
	p := writeConf(t, "seed = file:1\ninstance = fromfile\n", 0o600)
	if err := Parse(fs, []string{"--seed", "cli:1", "--seed", "cli:2", "--config", p}); err != nil {
		t.Fatal(err)
	}
	if got := seeds.String(); got != "cli:1,cli:2" || *v["instance"].(*string) != "fromfile" {
		t.Fatalf("seeds %q instance %q, want cli:1,cli:2 and fromfile", got, *v["instance"].(*string))
	}
}
