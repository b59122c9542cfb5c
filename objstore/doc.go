// Package objstore is kvtier's client of an S3-compatible object store,
// the L3 tier behind a rankd's L2 files: a thin, configured wrapper of
// minio-go (github.com/minio/minio-go/v7) that puts, reads, lists and
// removes objects under one bucket and prefix.
//
// It knows nothing of kvtier's objects: the L3 object format (the L2
// file format, header and checksums) and its verification live in
// transfer (transfer.L3Tier), which uses a *Store through the
// transfer.ObjectStore interface.
//
// The package must never: take credentials from the command line or the
// environment (only from the file Config.CredentialsFile names, which
// must be a regular file owned by this user or root and not readable by
// group or others), block opening a configured file (a FIFO is refused
// after a non-blocking open), talk plain HTTP unless
// Config.Insecure says so (and, to an endpoint off loopback, also
// Config.InsecureRemote), follow a symlink to its credentials or CA file,
// or create, configure or delete buckets.
package objstore
