package campaign

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"

	"github.com/kvtier/kvtier/objstore"
)

// l3Bucket is the campaign's L3 bucket.
const l3Bucket = "kvtier"

// l3Server is the campaign's L3: an S3 server (gofakes3, memory backend)
// in the campaign's own process, over real HTTP on the address the
// rankds reach (the bridge with namespaces). L3 faults edit its backend
// directly, as a damaged or misbehaving object store would.
type l3Server struct {
	be       *s3mem.Backend
	ln       net.Listener
	srv      *http.Server
	endpoint string // host:port
	creds    string // the rankds' credentials file
	done     chan struct{}
}

// startL3 serves a bucket on host (port chosen by the kernel) and writes
// the credentials file into dir.
func startL3(host, dir string) (*l3Server, error) {
	be := s3mem.New()
	if err := be.CreateBucket(l3Bucket); err != nil {
		return nil, fmt.Errorf("L3 bucket: %w", err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, fmt.Errorf("L3 listen: %w", err)
	}
	s := &l3Server{be: be, ln: ln, endpoint: ln.Addr().String(), creds: filepath.Join(dir, "l3-credentials.json"),
		done: make(chan struct{})}
	b, _ := json.Marshal(objstore.Credentials{AccessKeyID: "kvtier-campaign", SecretAccessKey: "kvtier-campaign-secret"})
	if err := os.WriteFile(s.creds, b, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	s.srv = &http.Server{Handler: gofakes3.New(be).Server(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

// close stops the server and waits for it.
func (s *l3Server) close() {
	_ = s.srv.Close()
	<-s.done
}

// objects lists the object names of kvtier objects, sorted (a pick
// indexes it).
func (s *l3Server) objects() []string {
	list, err := s.be.ListBucket(l3Bucket, nil, gofakes3.ListBucketPage{})
	if err != nil {
		return nil
	}
	var out []string
	for _, c := range list.Contents {
		if strings.HasSuffix(c.Key, ".kvo") {
			out = append(out, c.Key)
		}
	}
	sort.Strings(out)
	return out
}

func (s *l3Server) get(name string) ([]byte, error) {
	o, err := s.be.GetObject(l3Bucket, name, nil)
	if err != nil {
		return nil, err
	}
	defer o.Contents.Close()
	return io.ReadAll(o.Contents)
}

func (s *l3Server) put(name string, b []byte) error {
	_, err := s.be.PutObject(l3Bucket, name, map[string]string{}, bytes.NewReader(b), int64(len(b)), nil)
	return err
}

// fault applies an L3 object fault to the object pick chooses; it returns
// the object's key text (its name less the directories and .kvo), or why
// it was skipped.
func (s *l3Server) fault(k Kind, pick uint64) (key, skip string) {
	names := s.objects()
	if len(names) == 0 {
		return "", "no L3 object yet"
	}
	name := names[pick%uint64(len(names))]
	key = strings.TrimSuffix(name[strings.LastIndex(name, "/")+1:], ".kvo")
	if k == L3Delete {
		if _, err := s.be.DeleteObject(l3Bucket, name); err != nil {
			return "", "delete: " + err.Error()
		}
		return key, ""
	}
	b, err := s.get(name)
	if err != nil || len(b) == 0 {
		return "", "empty or unreadable object"
	}
	switch k {
	case L3BitFlip:
		off := (pick >> 20) % uint64(len(b))
		b[off] ^= 1 << ((pick >> 8) & 7)
	case L3Truncate:
		b = b[:uint64(len(b))*((pick>>16)%100)/100]
	default:
		return "", "not an L3 fault"
	}
	if err := s.put(name, b); err != nil {
		return "", "put: " + err.Error()
	}
	return key, ""
}
