package uniqueindex

import (
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts every MySQL statement of
// the package without a warning (no deprecated syntax such as VALUES(col)).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	stash, del := rowlease.SweepStatementsMySQL("sqllock_lease", "token", 2)
	b := rowlease.New("uniqueindex", testdb.Open(t, sqllock.MySQL), sqllock.MySQL, rowlease.Defaults(), channel)
	b.EnableLine()
	defer b.Close()
	testdb.CheckMySQLStatements(t, map[string]string{
		"acquireMySQL":     acquireMySQL,
		"takeFreeMySQL":    takeFreeMySQL,
		"renewMySQL":       renewMySQL,
		"releaseMySQL":     releaseMySQL,
		"forgetMySQL":      forgetMySQL,
		"forgetProbeMySQL": forgetProbeMySQL,
		"unholdMySQL":      unholdMySQL,
		"checkMySQL":       checkMySQL,
		"sweepSelectMySQL": rowlease.CandidatesSQLMySQL("sqllock_lease", true),
		"sweepStashMySQL":  stash,
		"sweepDeleteMySQL": del,
		"acquireLineMySQL": (&Locker{b: b}).acquireText(true, []byte("k"), "n", []byte("o"), 1000, true, time.Second),
		"releaseLineMySQL": fmt.Sprintf(releaseLineMySQL, "X'00'", "X'00'", 1, b.Line.MyRelease("X'00'")),
	})
}
