package fence_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts the MySQL statements that draw
// tokens without a warning (no deprecated syntax).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	testdb.CheckMySQLStatements(t, map[string]string{
		"NextMySQL":                 fence.NextMySQL,
		"Draw":                      fence.MySQLRun{}.Draw(),
		"TryLockDraw":               fence.MySQLRun{}.TryLockDraw("GET_LOCK('sqllock:check', 0)"),
		"Draw (NewestEpoch)":        fence.MySQLRun{NewestEpoch: true}.Draw(),
		"TryLockDraw (NewestEpoch)": fence.MySQLRun{NewestEpoch: true}.TryLockDraw("GET_LOCK('sqllock:check', 0)"),
	})
}

// TestEpochShift: the statements that place the epoch above the counter use
// EpochShift, spelled as numbers in their text.
func TestEpochShift(t *testing.T) {
	shift := strconv.FormatInt(1<<fence.EpochShift, 10)
	if !strings.Contains(fence.EpochPostgres, "* "+shift+" +") {
		t.Errorf("EpochPostgres does not multiply by %s: %s", shift, fence.EpochPostgres)
	}
	for _, s := range []string{fence.MySQLRun{NewestEpoch: true}.Draw(), fence.MySQLRun{NewestEpoch: true}.TryLockDraw("GET_LOCK('x', 0)")} {
		if !strings.Contains(s, "r.epoch << "+strconv.Itoa(fence.EpochShift)+")") {
			t.Errorf("not shifted by %d: %s", fence.EpochShift, s)
		}
	}
}
