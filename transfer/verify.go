package transfer

import (
	"errors"
	"fmt"

	"github.com/kvtier/kvtier/checksum"
)

// verifyBytes checks p against its recorded kvsum64.
func verifyBytes(p []byte, sum uint64) error {
	if got := checksum.Sum(p); got != sum {
		return fmt.Errorf("%d B hash to kvsum64 %016x, recorded %016x: %w", len(p), got, sum, ErrCorrupt)
	}
	return nil
}

func isCorrupt(err error) bool { return errors.Is(err, ErrCorrupt) }
