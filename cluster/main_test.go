package cluster

import (
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.Main(m)
}
