package cuda_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain is the package's only TestMain (host and driver tests share the
// test binary): no test may leave a goroutine behind.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
