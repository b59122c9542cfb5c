package index_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		// The crash-test child ingests until it is killed; goleak would
		// only see it die.
		os.Exit(m.Run())
	}
	goleak.VerifyTestMain(m)
}
