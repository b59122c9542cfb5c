package tier

// EncodeObject returns the bytes of an object file (the L2 file format,
// also the L3 object format): obj's header, then payload. obj.Size must be
// len(payload) and obj.Sum its kvsum64; key MACs the header (nil: a zero
// MAC, which a keyed tier does not announce). For tools and tests that build a
// tier's files directly (an importer, a 100k-object start-up test);
// FileTier.Put writes the same bytes durably.
func EncodeObject(obj L2Object, payload []byte, key *MACKey) []byte {
	hdr := encodeHeader(obj, key)
	out := make([]byte, 0, len(hdr)+len(payload))
	return append(append(out, hdr...), payload...)
}
