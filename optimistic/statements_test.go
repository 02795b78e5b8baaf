package optimistic

import (
	"testing"

	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts every MySQL statement of
// the package without a warning (no deprecated syntax such as VALUES(col)).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
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
		"sweepSelectMySQL": sweepSelectMySQL,
		"sweepFenceMySQL":  sweepFenceMySQL + "?" + sweepFenceTailMySQL,
		"sweepDeleteMySQL": sweepDeleteMySQL + "?)",
	})
}
