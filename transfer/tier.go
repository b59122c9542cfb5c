package transfer

import "github.com/kvtier/kvtier/transfer/tier"

// The durable tiers live in transfer/tier (they never take Engine.mu);
// these aliases keep the names callers and tests have always used.
type (
	// L2Object is tier.L2Object: what an object's header says.
	L2Object = tier.L2Object
	// ScanEntry is tier.ScanEntry: one object found by a tier's Scan.
	ScanEntry = tier.ScanEntry
	// L2Tier is tier.L2Tier: the durable tier behind L1.
	L2Tier = tier.L2Tier
	// CorruptError is tier.CorruptError: an object that failed verification.
	CorruptError = tier.CorruptError
	// FileTier is tier.FileTier: the L2 file tier.
	FileTier = tier.FileTier
	// L3Tier is tier.L3Tier: the L3 bucket tier.
	L3Tier = tier.L3Tier
	// ObjectStore is tier.ObjectStore: the bucket behind L3Tier.
	ObjectStore = tier.ObjectStore
	// MACKey is tier.MACKey: the cluster's storage MAC key (C12).
	MACKey = tier.MACKey
)

// OpenFileTier is tier.OpenFileTier.
func OpenFileTier(root string, key *MACKey) (*FileTier, error) { return tier.OpenFileTier(root, key) }

// NewL3Tier is tier.NewL3Tier.
func NewL3Tier(store ObjectStore, instance string, key *MACKey) *L3Tier {
	return tier.NewL3Tier(store, instance, key)
}

// NewEncryptingL3Tier is tier.NewEncryptingL3Tier.
func NewEncryptingL3Tier(store ObjectStore, instance string, key *MACKey) (*L3Tier, error) {
	return tier.NewEncryptingL3Tier(store, instance, key)
}

// NewMACKey is tier.NewMACKey.
func NewMACKey(secret []byte) (*MACKey, error) { return tier.NewMACKey(secret) }

// EncodeObject is tier.EncodeObject: the bytes of an object file.
func EncodeObject(obj L2Object, payload []byte, key *MACKey) []byte {
	return tier.EncodeObject(obj, payload, key)
}
