package optimistic

import (
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts every MySQL statement of
// the package without a warning (no deprecated syntax such as VALUES(col)).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	stash, del := rowlease.SweepStatementsMySQL("sqllock_optimistic", "version", 2)
	testdb.CheckMySQLStatements(t, map[string]string{
		"readMySQL":        readMySQL,
		"createMySQL":      createMySQL,
		"acquireMySQL":     acquireMySQL,
		"reenterMySQL":     reenterMySQL,
		"renewMySQL":       renewMySQL,
		"releaseMySQL":     releaseMySQL,
		"forgetMySQL":      forgetMySQL,
		"forgetProbeMySQL": forgetProbeMySQL,
		"checkMySQL":       checkMySQL,
		"sweepSelectMySQL": rowlease.CandidatesSQLMySQL("sqllock_optimistic", false),
		"sweepFenceMySQL":  stash,
		"sweepDeleteMySQL": del,
		"acquireLineMySQL": fmt.Sprintf(acquireLineMySQL, wait.MyEnter(wait.MyLineName("optimistic", "X'00'"), time.Second), "X'00'", "X'00'", 1000, "X'00'", 1),
		"releaseLineMySQL": fmt.Sprintf(releaseLineMySQL, "X'00'", 1, "X'00'", "4"),
	})
}
