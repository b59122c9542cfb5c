// Package powercut is a FUSE file system for tests that loses, at a
// simulated power cut, everything that was not made durable: the tool of
// the power-cut tests (docs/testing.md), in the spirit of LazyFS.
//
// Mount(t) mounts an empty one on a fresh directory; the code under test
// works beneath Dir() with ordinary system calls (bbolt included: files
// are served through the kernel's page cache, without direct I/O, so
// mmap works). Crash() cuts the power and remounts with only what was
// durable; CutAfter(n) cuts it in the middle of the work, at the (n+1)th
// mutating operation, so a test can crash at many points.
//
// What is modelled, strictly (POSIX, not what ext4 happens to do):
//
//   - A file's bytes and attributes change at once for every reader
//     (reads see unsynced data) and become durable only at fsync or
//     fdatasync of that file (both record the same: bytes, size, mode,
//     owner, mtime). close, flush and a sync of another file do nothing.
//     sync(2), syncfs and sync_file_range are not modelled: they make
//     nothing durable. Durable bytes are kept per 4 KiB page, copied on
//     write, so recording them costs a page table, not the file.
//   - A file's size is metadata that can reach the disk without the data
//     (as XFS or ext4 with data=writeback may leave it): after a crash a
//     file has the size it had at the cut, holding the bytes of its last
//     fsync, zeros past them. An unsynced O_TRUNC and rewrite of a file in
//     place leaves zeros; an unsynced append leaves a tail of zeros.
//   - Names (create, mkdir, unlink, rmdir, rename) change at once for
//     every reader and become durable only at fsync of the directory that
//     holds them: that fsync records the directory's whole name list as it
//     is, each name pointing at its inode. A rename across directories is
//     durable in each directory when that directory is fsynced: with only
//     the target synced, both names survive a crash (one inode, two
//     names); with only the source synced, neither does.
//   - An inode keeps its own last record: a name made durable for a file
//     never fsynced brings the file back with no synced bytes (zeros, at
//     its size at the cut), for a directory never fsynced, empty. A file
//     fsynced under a name that never became durable is gone.
//   - A power cut (Cut, CutAfter, Crash) makes every later mutating
//     operation of that mount fail with EIO and change nothing, the
//     operation that hits it included; reads go on. Crash then detaches
//     the mount (files still open on it keep their cut view) and mounts a
//     new generation built from the durable records, reachable from the
//     root through durable names.
//   - Not supported: hard links, symlinks, device nodes, xattrs, locks
//     forwarded to the file system (flock stays in the kernel, per mount),
//     fallocate; a directory renamed to another parent (EXDEV). No
//     permission checks (the tests run as one user).
//
// The durable state is kept in memory, in the server, not in a backing
// directory: a passthrough that applied names to a real directory at once
// could not lose them, and one that delayed them would need the same
// records anyway. Nothing is left on disk after a test.
//
// The server runs in a child process, the test binary started again with
// KVTIER_POWERCUT_MOUNT set (init in serve.go catches it before the
// tests run): a FUSE server in the process that mmaps its files can
// deadlock the Go runtime (a thread stuck in a page fault that waits for
// a server goroutine while a stop-the-world waits for that thread).
// Mount needs /dev/fuse and permission to mount (root, as here and in CI,
// uses mount(2); otherwise fusermount); without them the test is skipped,
// or failed when CI is set.
//
// This package never runs outside tests: importing it into a daemon would
// make that binary a file system server whenever KVTIER_POWERCUT_MOUNT is
// set.
package powercut
