package index_test

import (
	"os"
	"testing"

	"github.com/kvtier/kvtier/internal/testutil"
)

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		// The crash-test child ingests until it is killed; goleak would
		// only see it die.
		os.Exit(m.Run())
	}
	testutil.Main(m)
}
