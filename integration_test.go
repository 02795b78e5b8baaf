package sqllock_test

import (
	"os"
	"testing"

	"github.com/sqllock/sqllock/testdb"
)

// TestMain starts no server by itself: testdb starts one container per dialect on
// first use (or uses the DSN variables) and Main terminates them after the run.
func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }
