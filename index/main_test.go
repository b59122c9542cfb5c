package index_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvtier/kvtier/index"
)

func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		// The crash-test child ingests until it is killed; goleak would
		// only see it die.
		os.Exit(m.Run())
	}
	// Every index of these tests publishes with several goroutines
	// (Config.PublishFan), which a 2-core machine's default would not;
	// the coordinator's and rankd's tests run the default.
	index.SetAutoFan(4)
	goleak.VerifyTestMain(m)
}
