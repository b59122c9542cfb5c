package cuda_test

import (
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
)

// TestMain is the package's only TestMain (host and driver tests share the
// test binary): no test may leave a goroutine behind.
func TestMain(m *testing.M) { testutil.Main(m) }
