// Command s3node is an e2e test helper: an S3 server (gofakes3, memory
// backend) in a process of its own, for the tests that attack L3 through
// a real S3 server process (issue 28.1) rather than one inside the test.
// It serves one bucket over plain HTTP on --addr, writes the credentials
// file the rankds read, prints "s3node: serving HOST:PORT" and runs until
// SIGTERM or SIGINT. Not a production command.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"

	"github.com/kvtier/kvtier/objstore"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "s3node:", err)
		os.Exit(1)
	}
}

func run() error {
	fs := flag.NewFlagSet("s3node", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:0", "listen address host:port (port 0: chosen by the kernel)")
	bucket := fs.String("bucket", "kvtier", "the bucket to create")
	credsFile := fs.String("credentials", "", "write the rankds' 0600 S3 credentials file here (required)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if *credsFile == "" {
		return errors.New("--credentials is required")
	}
	be := s3mem.New()
	if err := be.CreateBucket(*bucket); err != nil {
		return fmt.Errorf("bucket %s: %w", *bucket, err)
	}
	b, _ := json.Marshal(objstore.Credentials{AccessKeyID: "kvtier-s3node", SecretAccessKey: "kvtier-s3node-secret"})
	if err := os.WriteFile(*credsFile, b, 0o600); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: gofakes3.New(be).Server(), ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	fmt.Printf("s3node: serving %s bucket %s\n", ln.Addr(), *bucket)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	select {
	case <-sig:
		return srv.Close()
	case err := <-done:
		return err
	}
}
