package tier

import "errors"

// Sentinel errors of the durable tiers. Every error this package returns
// wraps one of them with the rule that failed and the numbers; callers use
// errors.Is. The transfer package aliases each (transfer.ErrCorrupt is
// tier.ErrCorrupt), so a caller of the engine tests the same values; the
// messages keep their "transfer:" prefix, as before the tiers moved here.
var (
	// ErrConfig: a tier was opened with a setting that breaks a rule (an
	// empty L2 root).
	ErrConfig = errors.New("transfer: invalid config")
	// ErrNotFound: the tier holds no object of the key.
	ErrNotFound = errors.New("transfer: object not found")
	// ErrCorrupt: an object's bytes or file failed verification (checksum,
	// length, fingerprint, header). Corrupt L2 files are quarantined,
	// corrupt L3 objects deleted.
	ErrCorrupt = errors.New("transfer: object failed verification")
	// ErrIO: a read or write of the tier failed for a reason other than
	// corruption.
	ErrIO = errors.New("transfer: L2 I/O error")
	// ErrUnsafe is wrapped (with ErrIO) by a tier operation refused by a
	// file safety rule: a symlink, a foreign owner, a group/world-writable
	// root.
	ErrUnsafe = errors.New("transfer: unsafe L2 path")
	// ErrUnverified is wrapped (with ErrCorrupt) by an object whose header
	// MAC does not verify with this cluster's storage key (C12): written by
	// another cluster, with a rotated key, by a version without MACs
	// (format 1), or forged by someone who can write the tier. Such an
	// object is never announced nor served; a scan counts it.
	ErrUnverified = errors.New("transfer: object header MAC does not verify")
)
