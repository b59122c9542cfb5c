package tier

import (
	"fmt"
	"time"

	"github.com/kvtier/kvtier/checksum"
	"github.com/kvtier/kvtier/dcp"
	"github.com/kvtier/kvtier/internal/testutil"
	"github.com/kvtier/kvtier/wire"
)

// testObj is object i of 4096 random bytes (as the transfer package's
// safetyObj), written by rank test/0.
func testObj(i int) (L2Object, []byte) {
	var ch dcp.ChunkHash
	copy(ch[:], fmt.Sprintf("chunk-%010d", i))
	p := testutil.RandomBytes(4096, uint64(i))
	return L2Object{Key: dcp.Key{NS: dcp.Namespace{7}, Chunk: ch}, Writer: wire.Rank{Instance: "test", TPRank: 0},
		Size: uint64(len(p)), Sum: checksum.Sum(p), Created: time.Unix(1, 0)}, p
}
