package checksum

// Vector is a kvsum64 test vector: VectorInput(N) digests to Sum. Every
// implementation of kvsum64 (the Go one here, the CUDA copy kernels) must
// reproduce all of Vectors; package checksum's tests cross-check them
// against a byte-at-a-time reference of the definition in doc.go.
type Vector struct {
	N   int
	Sum uint64
}

// Vectors covers the empty input, partial and whole words, the seed row
// widths 561 and 656, and a page.
var Vectors = []Vector{
	{0, 0x9ca066f1a4ab2eea},
	{1, 0xd81bead167cdc3e4},
	{7, 0xba783eba9ec7cfc9},
	{8, 0x0e5723504320ba15},
	{15, 0x6df0fb5a2c3dc2ac},
	{16, 0x2c0dec473029f5bc},
	{17, 0xcd10a9de862921c2},
	{561, 0x3333ae14f004cc91},
	{656, 0x371fd43698bc0325},
	{4096, 0x6bf1916d547f8a1d},
}

// VectorInput returns the input of a test vector: n bytes b[k] = byte(k*7 + 3).
func VectorInput(n int) []byte {
	b := make([]byte, n)
	for k := range b {
		b[k] = byte(k*7 + 3)
	}
	return b
}
