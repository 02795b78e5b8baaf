package uniqueindex

import (
	"testing"

	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts every MySQL statement of
// the package without a warning (no deprecated syntax such as VALUES(col)).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	testdb.CheckMySQLStatements(t, map[string]string{
		"acquireMySQL":     acquireMySQL,
		"renewMySQL":       renewMySQL,
		"releaseMySQL":     releaseMySQL,
		"forgetMySQL":      forgetMySQL,
		"forgetProbeMySQL": forgetProbeMySQL,
		"unholdMySQL":      unholdMySQL,
		"unholdDoneMySQL":  unholdDoneMySQL,
		"checkMySQL":       checkMySQL,
		"sweepSelectMySQL": sweepSelectMySQL,
		"sweepDeleteMySQL": sweepDeleteMySQL + "?)",
	})
}
