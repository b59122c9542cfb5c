package objstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"testing"

	"github.com/kvtier/kvtier/objstore/objstoretest"
)

// TestDeletedBetweenOpenAndRead: minio-go's Open is a HEAD; the GET comes
// with the first read. An object deleted in between (another rank deleted
// it as corrupt, an eviction) reads as fs.ErrNotExist, not as an I/O
// failure, so the caller knows the object is gone. Seen failing before:
// the read gave minio's NoSuchKey response, not fs.ErrNotExist.
func TestDeletedBetweenOpenAndRead(t *testing.T) {
	ctx := context.Background()
	srv := objstoretest.Start(t)
	s := open(t, srv, "p/")
	data := bytes.Repeat([]byte{7, 9}, 1<<19)
	if err := s.Put(ctx, "x.kvo", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	body, size, err := s.Open(ctx, "x.kvo", 0, 0)
	if err != nil || size != int64(len(data)) {
		t.Fatalf("open: %d B, %v", size, err)
	}
	defer body.Close()
	if err := s.Delete(ctx, "x.kvo"); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(body)
	if len(got) != 0 || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("read after the delete: %d B, err %v; want fs.ErrNotExist", len(got), err)
	}
}
