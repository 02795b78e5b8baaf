package forupdate

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts the MySQL locking statements
// without a warning, in every form an acquisition sends (waiting or NOWAIT, with
// the server's wait bound where the flavour has one).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	db := testdb.Open(t, sqllock.MySQL) // may start the server's container: before the deadline
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f, err := testdb.FlavorOf(ctx, db, sqllock.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	flavor := flavorMySQL8
	if f == testdb.FlavorMariaDB {
		flavor = flavorMariaDB
	}
	key := make([]byte, 32)
	stmts := map[string]string{"myAnyFmt": fmt.Sprintf(myAnyFmt, placeholders(2))}
	for _, draw := range []bool{false, true} {
		for _, nowait := range []bool{false, true} {
			s := myLocking(draw, newMarker(), key, nowait)
			stmts[s] = s
			if b, ok := serverWaitBound(flavor, time.Second, s); ok {
				stmts[b] = b
			}
		}
	}
	testdb.CheckMySQLStatements(t, stmts)
}
