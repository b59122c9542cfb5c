// Package tier holds kvtier's durable tiers behind L1: the L2 file tier
// (FileTier: one file per object under a root shared by the ranks of a
// host, written to a temporary name, fsynced, renamed and the directory
// fsynced; verified on every read; quarantined when corrupt; old garbage
// collected), the L3 bucket tier (L3Tier over an ObjectStore) and the one
// object format both use (a checksummed header carrying a MAC keyed with
// the cluster's storage key, then the payload; EncodeObject, HeaderBytes,
// MACKey). A header whose MAC does not verify is ErrUnverified (C12): a
// scan never reports it as an object, so its sum never becomes a
// recorded one.
//
// Its sentinel errors live in errors.go; the transfer package aliases them
// and the tier types, so callers of the engine keep the transfer names.
//
// The package must never: take or know of the engine's lock (it has no
// lock and no goroutine of its own; every method is safe for concurrent
// use); acknowledge a Put before the object is durable; return bytes it
// has not verified against their recorded checksum, key and fingerprint
// (and, with a key, the header's MAC); store its MAC key beside the
// objects;
// follow a symlink or write beneath a root another user owns; or serve a
// quarantined object again.
package tier
