package forupdate

import (
	"database/sql"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/testdb"
)

// TestRaiseCounterOnce: a session that comes to raise sqllock_rowlock's
// AUTO_INCREMENT to an epoch's value after another session raised it, drew the run's
// first token and holds that lease (clients reconnecting at once after a restart, each
// having read the run as new) must not wait for that lease. A second REPLACE of the
// same value did: its check of the token's unique index locked the entry after that
// value, the held lease's token (3 s here, with innodb_lock_wait_timeout at 3 s;
// 50 s by default). raiseCounter takes the epoch row's lock first and writes only
// if the value is lower.
func TestRaiseCounterOnce(t *testing.T) {
	d := sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	conn := func() *sql.Conn {
		t.Helper()
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	const epoch = 7
	if err := raiseCounter(ctx, conn(), epoch, false); err != nil {
		t.Fatalf("first raise: %v", err)
	}
	// A lease of the run: its REPLACE draws the first token after the raised value,
	// and its transaction stays open.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, "REPLACE INTO sqllock_rowlock (lock_key, name) VALUES (x'0100000000000000000000000000000000000000000000000000000000000000', 'held')")
	if err != nil {
		t.Fatal(err)
	}
	if tok, _ := res.LastInsertId(); tok != epoch<<fence.EpochShift+1 {
		t.Fatalf("the held lease's token %d, want %d (the raised value + 1)", tok, epoch<<fence.EpochShift+1)
	}
	c2 := conn()
	if _, err := c2.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 3"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = raiseCounter(ctx, c2, epoch, true)
	took := time.Since(start)
	t.Logf("second raise: %v in %v", err, took.Round(time.Millisecond))
	if err != nil || took > 2*time.Second {
		t.Errorf("second raise of the same epoch: %v after %v; want nil at once (it waited for the held lease)", err, took)
	}
}
