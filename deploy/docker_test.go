package deploy

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

const dockerfile = "docker/Dockerfile"

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	line int
	cmd  string // upper case
	args string
}

// readDockerfile splits a Dockerfile into instructions: comments and
// blank lines dropped, lines ending in a backslash joined to the next.
func readDockerfile(data string) []instruction {
	var out []instruction
	var cur strings.Builder
	start := 0
	sc := bufio.NewScanner(strings.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if cur.Len() == 0 {
			start = n
		}
		cont := strings.HasSuffix(line, "\\")
		cur.WriteString(strings.TrimSuffix(line, "\\"))
		cur.WriteString(" ")
		if cont {
			continue
		}
		cmd, args, _ := strings.Cut(strings.TrimSpace(cur.String()), " ")
		out = append(out, instruction{start, strings.ToUpper(cmd), strings.TrimSpace(args)})
		cur.Reset()
	}
	return out
}

// stage is one FROM ... of a Dockerfile and its instructions.
type stage struct {
	from, name string
	ins        []instruction
}

var buildOut = regexp.MustCompile(`go build [^&;]*?-o (\S+) ((?:\./cmd/\S+\s*)+)`)

// dockerfileErrors checks what the image promises (docs/deploy.md): a
// multi-stage build whose last stage is not the builder and runs as a
// numeric non-root user (Kubernetes' runAsNonRoot can only check a
// number), and copies from the builder every daemon the builder builds:
// coordinator, rankd and enginesim.
func dockerfileErrors(data string) []error {
	var errs []error
	var stages []stage
	for _, in := range readDockerfile(data) {
		if in.cmd == "FROM" {
			f := strings.Fields(in.args)
			s := stage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			}
			stages = append(stages, s)
			continue
		}
		if len(stages) == 0 {
			if in.cmd != "ARG" {
				errs = append(errs, fmt.Errorf("line %d: %s before FROM", in.line, in.cmd))
			}
			continue
		}
		stages[len(stages)-1].ins = append(stages[len(stages)-1].ins, in)
	}
	if len(stages) < 2 {
		return append(errs, fmt.Errorf("%d stages, want a builder and a runtime stage", len(stages)))
	}
	built := map[string]string{} // binary path in the builder -> stage name
	for _, s := range stages[:len(stages)-1] {
		for _, in := range s.ins {
			if in.cmd != "RUN" {
				continue
			}
			for _, m := range buildOut.FindAllStringSubmatch(in.args, -1) {
				for _, pkg := range strings.Fields(m[2]) {
					bin := m[1]
					if strings.HasSuffix(bin, "/") {
						bin += path.Base(pkg)
					}
					built[bin] = s.name
				}
			}
		}
	}
	last := stages[len(stages)-1]
	if strings.Contains(last.from, "golang") {
		errs = append(errs, fmt.Errorf("the runtime stage is %s: the toolchain would ship", last.from))
	}
	user := ""
	copied := map[string]bool{}
	for _, in := range last.ins {
		switch in.cmd {
		case "USER":
			user = in.args
		case "COPY":
			f := strings.Fields(in.args)
			if len(f) < 3 || !strings.HasPrefix(f[0], "--from=") {
				continue
			}
			from := strings.TrimPrefix(f[0], "--from=")
			for _, src := range f[1 : len(f)-1] {
				if built[src] == from {
					copied[path.Base(src)] = true
				} else {
					errs = append(errs, fmt.Errorf("line %d: copies %s from %s, which does not build it", in.line, src, from))
				}
			}
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		errs = append(errs, fmt.Errorf("the runtime stage runs as user %q: want a numeric non-root uid", user))
	}
	for _, bin := range []string{"coordinator", "rankd", "enginesim"} {
		if !copied[bin] {
			errs = append(errs, fmt.Errorf("the runtime stage has no %s built by the builder", bin))
		}
	}
	return errs
}

// TestDockerfile: the image's Dockerfile keeps its promises (see
// dockerfileErrors), and the .dockerignore at the repository root (the
// build context) leaves out neither go.mod nor a directory of Go source.
// A root user, a daemon not copied and a copy of a binary the builder
// does not make are caught. (docker build itself needs a daemon and the
// base images; docs/deploy.md says how to build.)
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range dockerfileErrors(string(data)) {
		t.Error(err)
	}

	bad := strings.Replace(string(data), "USER 65532:65532", "USER root", 1)
	bad = strings.Replace(bad, "/out/coordinator /out/rankd /out/enginesim /usr/local/bin/", "/out/coordinator /out/enginesim /out/kvtierd /usr/local/bin/", 1)
	var got []string
	for _, err := range dockerfileErrors(bad) {
		got = append(got, err.Error())
	}
	want := `line 30: copies /out/kvtierd from build, which does not build it|` +
		`the runtime stage runs as user "root": want a numeric non-root uid|` +
		`the runtime stage has no rankd built by the builder`
	if strings.Join(got, "|") != want {
		t.Fatalf("errors for the bad Dockerfile:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.ReplaceAll(want, "|", "\n"))
	}

	ign, err := os.ReadFile("../.dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	var patterns []string
	for _, l := range strings.Split(string(ign), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			patterns = append(patterns, strings.TrimPrefix(l, "**/"))
		}
	}
	if !ignored(patterns, ".git") {
		t.Error(".dockerignore does not leave out .git")
	}
	for _, f := range []string{"go.mod", "go.sum"} {
		if ignored(patterns, f) {
			t.Errorf(".dockerignore leaves out %s", f)
		}
	}
	err = filepath.WalkDir("..", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() && (d.Name() == ".git" || d.Name() == "python") {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel("..", p)
		if !d.IsDir() && strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") && ignoredPath(patterns, filepath.ToSlash(rel)) {
			t.Errorf(".dockerignore leaves out %s", rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ignored reports whether a pattern (path.Match syntax, as .dockerignore
// has with **/ stripped) matches name.
func ignored(patterns []string, name string) bool {
	for _, p := range patterns {
		if ok, _ := path.Match(p, name); ok {
			return true
		}
	}
	return false
}

// ignoredPath reports whether rel or one of its parent directories is
// ignored.
func ignoredPath(patterns []string, rel string) bool {
	for p := rel; p != "." && p != "/"; p = path.Dir(p) {
		if ignored(patterns, p) || ignored(patterns, path.Base(p)) {
			return true
		}
	}
	return false
}
