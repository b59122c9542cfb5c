// Package hostl1 is the host-shared L1 segment (issue 15.1): a rank's L1
// slabs in a shared-memory file of a private directory, with a lock-free
// catalog of the objects they hold that the other ranks of the same host
// and instance search and lease without a message to the holder.
//
// The holder (the engine of package transfer) creates its segment with
// Create, publishes every committed L1 object with Publish and retires it
// with Retire (one writer: the engine calls them under its own lock), asks
// Leased before it evicts, and ends it with Close. A reader maps a peer's
// segment with OpenPeer, finds an object with Find, takes a lease with
// Lease (then reads the bytes at Slot.Off straight from Peer.Data) and
// gives it back with Unlease; HolderAlive and Inode tell it when the
// holder died (kill -9: its flock is gone) or replaced the file.
//
// The package never takes a lock of the engine and holds none of its own:
// the catalog is atomics, seqlocked slots and leases (segment.go). Its
// files follow C9 (file.go): a private directory of this uid (created
// 0700 when missing; a squatter's is refused, never used), files
// created O_EXCL|O_NOFOLLOW 0600 and renamed into place, peers accepted
// only as private regular files of this uid. Its sentinel errors are its
// own (ErrConfig, ErrCorrupt, ErrIO, ErrNotFound, ErrFull); package
// transfer matches them to its sentinels of the same meaning.
//
// The package must never: let a reader see a torn slot; let a reader use
// a slot whose generation changed after it took its lease; read a segment
// whose holder died; follow a symlink or accept a file another uid could
// have written.
package hostl1
