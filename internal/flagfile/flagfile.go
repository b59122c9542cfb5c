package flagfile

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// FlagName is the flag Parse defines on the flag set: --config <file>.
const FlagName = "config"

// MaxFileBytes bounds a config file. A config of flags is a few hundred
// bytes; anything near this is not one.
const MaxFileBytes = 1 << 20

// Errors. Each error Parse and Load return wraps exactly one of them and
// names the file and, where there is one, the line.
var (
	// ErrSyntax: a line is neither blank, a comment nor "key = value", or a
	// quoted value is not a valid Go string literal.
	ErrSyntax = errors.New("flagfile: syntax error")
	// ErrUnknownKey: a key names no flag of the command.
	ErrUnknownKey = errors.New("flagfile: unknown key")
	// ErrDuplicateKey: a key appears twice in one file.
	ErrDuplicateKey = errors.New("flagfile: duplicate key")
	// ErrValue: the flag refused the value.
	ErrValue = errors.New("flagfile: invalid value")
	// ErrSecret: a key the caller marked secret appears in the file.
	ErrSecret = errors.New("flagfile: secret in config file")
	// ErrNested: the file has a "config" key.
	ErrNested = errors.New("flagfile: config file names another config file")
	// ErrUnsafeFile: the file is not a regular file, is writable by group or
	// others, is owned by another user than root or the caller, or exceeds
	// MaxFileBytes.
	ErrUnsafeFile = errors.New("flagfile: unsafe config file")
)

// Setting is one "key = value" line of a config file.
type Setting struct {
	Key   string
	Value string
	Line  int // 1-based
}

// ParseSettings parses the text of a config file. It checks syntax and
// duplicate keys only; whether a key is a flag is Apply's business.
func ParseSettings(data []byte) ([]Setting, error) {
	var out []Setting
	seen := make(map[string]int)
	for i, raw := range bytes.Split(data, []byte("\n")) {
		n := i + 1
		line := strings.TrimSpace(strings.TrimSuffix(string(raw), "\r"))
		if line == "" || line[0] == '#' {
			continue
		}
		eq := strings.IndexByte(line, '=')
		if eq < 0 {
			return nil, fmt.Errorf("line %d: %q has no '=': want key = value: %w", n, clip(line), ErrSyntax)
		}
		key := strings.TrimSpace(line[:eq])
		if err := checkKey(key); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		val, err := parseValue(strings.TrimSpace(line[eq+1:]))
		if err != nil {
			return nil, fmt.Errorf("line %d: key %q: %w", n, key, err)
		}
		if prev, ok := seen[key]; ok {
			return nil, fmt.Errorf("line %d: key %q already set on line %d: %w", n, key, prev, ErrDuplicateKey)
		}
		seen[key] = n
		out = append(out, Setting{Key: key, Value: val, Line: n})
	}
	return out, nil
}

// checkKey accepts flag names: letters, digits, '-', '_' and '.', not
// starting with '-'.
func checkKey(key string) error {
	if key == "" {
		return fmt.Errorf("empty key before '=': %w", ErrSyntax)
	}
	if key[0] == '-' {
		return fmt.Errorf("key %q: write the flag name without dashes: %w", clip(key), ErrSyntax)
	}
	for _, r := range key {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("key %q: character %q is not allowed in a flag name: %w", clip(key), r, ErrSyntax)
		}
	}
	return nil
}

// parseValue returns the value of the text after '=' (already trimmed):
// a Go string literal in double quotes, or the text up to a '#' that
// follows whitespace.
func parseValue(s string) (string, error) {
	if strings.HasPrefix(s, `"`) {
		lit, err := strconv.QuotedPrefix(s)
		if err != nil {
			return "", fmt.Errorf("value %s is not a valid double-quoted string: %w", clip(s), ErrSyntax)
		}
		rest := strings.TrimSpace(s[len(lit):])
		if rest != "" && rest[0] != '#' {
			return "", fmt.Errorf("text %q after the quoted value: %w", clip(rest), ErrSyntax)
		}
		v, err := strconv.Unquote(lit)
		if err != nil {
			return "", fmt.Errorf("value %s: %w", clip(lit), ErrSyntax)
		}
		return v, nil
	}
	for i := 1; i < len(s); i++ {
		if s[i] == '#' && (s[i-1] == ' ' || s[i-1] == '\t') {
			return strings.TrimSpace(s[:i]), nil
		}
	}
	if strings.HasPrefix(s, "#") {
		return "", nil
	}
	return s, nil
}

// clip shortens text quoted in an error.
func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// Apply sets each flag that settings name and the command line did not set
// (fs.Visit: call it after fs.Parse, so the command line wins). secrets are
// flag names refused in a file. Every key is checked, set or not; a value is
// checked by its flag only where it is applied. It stops at the first error,
// which names path and the line.
func Apply(fs *flag.FlagSet, path string, settings []Setting, secrets ...string) error {
	onCmdLine := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { onCmdLine[f.Name] = true })
	for _, s := range settings {
		if s.Key == FlagName {
			return fmt.Errorf("config %s:%d: key %q: %w", path, s.Line, s.Key, ErrNested)
		}
		for _, sec := range secrets {
			if s.Key == sec {
				return fmt.Errorf("config %s:%d: key %q holds a secret; give it on the command line or through its file flag: %w",
					path, s.Line, s.Key, ErrSecret)
			}
		}
		if fs.Lookup(s.Key) == nil {
			return fmt.Errorf("config %s:%d: key %q is not a flag of %s: %w", path, s.Line, s.Key, filepath.Base(fs.Name()), ErrUnknownKey)
		}
		if onCmdLine[s.Key] {
			continue
		}
		if err := fs.Set(s.Key, s.Value); err != nil {
			return fmt.Errorf("config %s:%d: key %q: value %q refused: %w: %w", path, s.Line, s.Key, clip(s.Value), ErrValue, err)
		}
	}
	return nil
}

// Load reads the config file at path, checks that it is safe to trust
// (CheckFile) and applies it to the flags of fs the command line did not
// set (Apply). Call it after fs.Parse. An empty path is no file: nil.
func Load(fs *flag.FlagSet, path string, secrets ...string) error {
	if path == "" {
		return nil
	}
	// O_NONBLOCK: opening a FIFO must not wait for a writer; the mode check
	// below refuses it.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	uid := -1
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		uid = int(st.Uid)
	}
	if err := CheckFile(info.Mode(), info.Size(), uid, os.Geteuid()); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileBytes+1))
	if err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	if len(data) > MaxFileBytes {
		return fmt.Errorf("config %s: grew past %d bytes while read: %w", path, MaxFileBytes, ErrUnsafeFile)
	}
	settings, err := ParseSettings(data)
	if err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return Apply(fs, path, settings, secrets...)
}

// CheckFile is the rule a config file must pass: a regular file of at most
// MaxFileBytes, not writable by group or others, owned by root (uid 0) or
// by euid. uid -1 means the owner is unknown (not a Unix file system) and
// is not checked.
func CheckFile(mode fs.FileMode, size int64, uid, euid int) error {
	if !mode.IsRegular() {
		return fmt.Errorf("mode %v: not a regular file: %w", mode, ErrUnsafeFile)
	}
	if perm := mode.Perm(); perm&0o022 != 0 {
		return fmt.Errorf("mode %04o lets group or others write it (it decides which credentials the daemon loads); chmod go-w: %w",
			perm, ErrUnsafeFile)
	}
	if uid >= 0 && uid != 0 && uid != euid {
		return fmt.Errorf("owned by uid %d, neither root nor this process's uid %d: %w", uid, euid, ErrUnsafeFile)
	}
	if size > MaxFileBytes {
		return fmt.Errorf("%d bytes exceeds the %d-byte limit: %w", size, MaxFileBytes, ErrUnsafeFile)
	}
	return nil
}

// Define defines --config on fs and returns where its value goes: give it
// to Load after fs.Parse.
func Define(fs *flag.FlagSet) *string {
	return fs.String(FlagName, "", "config file of `flag-name = value` lines (see deploy/examples); flags on the command line win")
}

// Parse is Define, fs.Parse(args) and Load: flags on the command line
// override the file. secrets are flag names refused in the file.
//
// Errors of the command line are flag.FlagSet.Parse's own. A file error is
// printed to fs.Output() and handled as fs's ErrorHandling says (returned,
// os.Exit(2) or panic), like a command-line error.
func Parse(fs *flag.FlagSet, args []string, secrets ...string) error {
	path := Define(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := Load(fs, *path, secrets...); err != nil {
		fmt.Fprintln(fs.Output(), err)
		switch fs.ErrorHandling() {
		case flag.ExitOnError:
			os.Exit(2)
		case flag.PanicOnError:
			panic(err)
		}
		return err
	}
	return nil
}
