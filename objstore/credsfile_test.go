package objstore_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvtier/kvtier/objstore"
)

const goodCreds = `{"access_key_id":"a","secret_access_key":"b"}`

// readWithin calls read(path) and fails the test if it does not return
// within d: a FIFO opened for reading blocks until a writer comes, which
// at rankd's start is a hang.
func readWithin(t *testing.T, d time.Duration, path string, read func(string) error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- read(path) }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		// Unblock the reader so the goroutine ends: open the FIFO for writing.
		if w, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			_ = w.Close()
		}
		<-done
		t.Fatalf("reading %s did not return within %v (blocked on open)", path, d)
		return nil
	}
}

// TestCredentialsFileRefusals (issue 28.5): the S3 credentials file is
// loaded as the seed files are: no symlink, a regular file (a FIFO is
// refused at once, not waited on), owned by this user or root, no group or
// other access, bounded size. Each refusal names the path and the rule.
func TestCredentialsFileRefusals(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		return p
	}
	good := write("good.json", goodCreds, 0o600)
	if c, err := objstore.ReadCredentials(good); err != nil || c.AccessKeyID != "a" || c.SecretAccessKey != "b" {
		t.Fatalf("good file: %+v, %v", c, err)
	}
	fifo := filepath.Join(dir, "fifo.json")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.json")
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	big := write("big.json", `{"access_key_id":"a","secret_access_key":"`+strings.Repeat("b", 70<<10)+`"}`, 0o600)
	type refusal struct{ name, path, want string }
	cases := []refusal{
		{"FIFO", fifo, "not a regular file"},
		{"symlink", link, "symlink"},
		{"directory", dir, "not a regular file"},
		{"group-readable", write("group.json", goodCreds, 0o640), "mode 0640"},
		{"world-readable", write("world.json", goodCreds, 0o604), "mode 0604"},
		{"over 64 KiB", big, "over 65536 B"},
		{"missing", filepath.Join(dir, "none.json"), "no such file"},
	}
	if os.Geteuid() == 0 { // only root can give a file away
		foreign := write("foreign.json", goodCreds, 0o600)
		if err := os.Chown(foreign, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		cases = append(cases, refusal{"owned by another user", foreign, "owned by uid 65534"})
	}
	for _, tc := range cases {
		err := readWithin(t, 10*time.Second, tc.path, func(p string) error {
			_, err := objstore.ReadCredentials(p)
			return err
		})
		if !errors.Is(err, objstore.ErrConfig) || !strings.Contains(err.Error(), tc.path) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v; want ErrConfig naming %s and %q", tc.name, err, tc.path, tc.want)
		}
	}
}

// TestCAFileFIFORefused: the CA file is opened the same way; a FIFO there
// is refused, not waited on, and so is a CA file others can write.
func TestCAFileFIFORefused(t *testing.T) {
	dir := t.TempDir()
	creds := filepath.Join(dir, "creds.json")
	if err := os.WriteFile(creds, []byte(goodCreds), 0o600); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "ca.pem")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	writable := filepath.Join(dir, "ca-open.pem")
	if err := os.WriteFile(writable, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(writable, 0o666); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{fifo: "not a regular file", writable: "mode 0666"} {
		c := objstore.DefaultConfig()
		c.Endpoint, c.Bucket, c.CredentialsFile, c.CAFile = "127.0.0.1:1", "b", creds, path
		err := readWithin(t, 10*time.Second, path, func(string) error {
			_, err := objstore.Open(t.Context(), c)
			return err
		})
		if !errors.Is(err, objstore.ErrConfig) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), want) {
			t.Errorf("CA file %s: err %v; want ErrConfig naming it and %q", path, err, want)
		}
	}
}
