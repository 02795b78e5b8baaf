package fence_test

import (
	"testing"

	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts the MySQL increment without
// a warning (no deprecated syntax).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	testdb.CheckMySQLStatements(t, map[string]string{"NextMySQL": fence.NextMySQL})
}
