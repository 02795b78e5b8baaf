package sqlerr_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// TestClassifyRealErrors provokes each class of error on the real servers and checks
// how it is classified.
func TestClassifyRealErrors(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		db := testdb.Open(t, d)
		admin := testdb.Open(t, d)
		table := fmt.Sprintf("sqllock_sqlerr_%d", os.Getpid())
		if _, err := db.ExecContext(ctx, "CREATE TABLE "+table+" (id int PRIMARY KEY)"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { admin.ExecContext(context.Background(), "DROP TABLE "+table) })
		if _, err := db.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1)"); err != nil {
			t.Fatal(err)
		}

		_, err := db.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1)")
		want(t, "duplicate key", err, sqlerr.Duplicate, true)

		_, err = db.ExecContext(ctx, "SELECT * FROM sqllock_no_such_table")
		want(t, "missing table", err, sqlerr.UndefinedTable, false)

		// A migration not applied: a column of the library's is missing.
		_, err = db.ExecContext(ctx, "SELECT no_such_column FROM "+table)
		want(t, "missing column", err, sqlerr.UndefinedTable, false)

		if d == sqllock.MySQL { // an index a migration adds, named by FORCE INDEX
			_, err = db.ExecContext(ctx, "SELECT id FROM "+table+" FORCE INDEX (no_such_index)")
			want(t, "missing index", err, sqlerr.UndefinedTable, false)
		}

		// A row lock held by one transaction, refused to another with NOWAIT.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(ctx, "SELECT id FROM "+table+" WHERE id = 1 FOR UPDATE"); err != nil {
			t.Fatal(err)
		}
		tx2, err := admin.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx2.ExecContext(ctx, "SELECT id FROM "+table+" WHERE id = 1 FOR UPDATE NOWAIT")
		want(t, "NOWAIT refused", err, sqlerr.LockTimeout, true)
		tx2.Rollback()
		tx.Rollback()

		// Two sessions each holding a session lock and waiting for the other's: the
		// server ends one wait with a deadlock error (MySQL 8 and later: 3058 for
		// user-level locks; MariaDB: 1213; PostgreSQL: 40P01 after deadlock_timeout).
		err = lockCycle(ctx, t, d, db, admin)
		want(t, "session lock deadlock", err, sqlerr.Deadlock, true)

		// A session killed by the server.
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		testdb.Kill(ctx, t, admin, d, testdb.SessionID(ctx, t, d, conn))
		// The kill is asynchronous on the server: the next statements fail once it lands.
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, err = conn.ExecContext(ctx, "SELECT 1")
			if err != nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond) // no signal exists for a server-side kill
		}
		want(t, "killed session", err, sqlerr.SessionLost, false)
	})
}

// lockCycle makes two sessions of db wait for each other's session lock (advisory
// lock, GET_LOCK), and returns the error the server ended one of the waits with.
func lockCycle(ctx context.Context, t *testing.T, d sqllock.Dialect, db, admin *sql.DB) error {
	t.Helper()
	lock := "SELECT pg_advisory_lock(%d)"
	if d == sqllock.MySQL {
		lock = "SELECT GET_LOCK('sqllock_sqlerr_%d', 30)"
	}
	base := 7340000 + int64(os.Getpid())*2
	var conns [2]*sql.Conn
	var ids [2]int64
	for i := range conns {
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// Closing the session frees whatever it still holds.
		t.Cleanup(func() { c.Raw(func(any) error { return driver.ErrBadConn }); c.Close() })
		ids[i] = testdb.SessionID(ctx, t, d, c)
		if _, err := c.ExecContext(ctx, fmt.Sprintf(lock, base+int64(i))); err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	type result struct {
		i   int
		err error
	}
	done := make(chan result, 2)
	wait := func(i int, key int64) {
		_, err := conns[i].ExecContext(ctx, fmt.Sprintf(lock, key))
		done <- result{i, err}
	}
	go wait(0, base+1)
	// Wait until the first session waits for the second's lock.
	for waiting := false; !waiting; {
		var err error
		if waiting, err = testdb.WaitsForLock(ctx, admin, d, ids[0]); err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-done:
			t.Fatalf("the first session's wait ended before the cycle: %v", r.err)
		default:
		}
	}
	go wait(1, base)
	// The server ends one wait (which one is its choice); that session then gives its
	// locks up, and the other's wait is granted.
	r := <-done
	unlockAll := "SELECT pg_advisory_unlock_all()"
	if d == sqllock.MySQL {
		unlockAll = "SELECT RELEASE_ALL_LOCKS()"
	}
	if _, err := conns[r.i].ExecContext(ctx, unlockAll); err != nil {
		t.Fatal(err)
	}
	if other := <-done; other.err != nil {
		t.Errorf("the other wait: %v", other.err)
	}
	return r.err
}

func want(t *testing.T, what string, err error, c sqlerr.Class, transient bool) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error", what)
	}
	if got := sqlerr.Classify(err); got != c {
		t.Errorf("%s: Classify(%v) = %d, want %d", what, err, got, c)
	}
	if sqlerr.Transient(err) != transient {
		t.Errorf("%s: Transient(%v) = %v, want %v", what, err, !transient, transient)
	}
}

func TestClassifyGeneric(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want sqlerr.Class
	}{
		{nil, sqlerr.Other},
		{driver.ErrBadConn, sqlerr.SessionLost},
		{fmt.Errorf("read: %w", io.ErrUnexpectedEOF), sqlerr.SessionLost},
		{context.Canceled, sqlerr.Other},
		{errors.New("something else"), sqlerr.Other},
		// Group Replication's certification conflicts, which one server cannot produce
		// (the ha suite's TestGroupReplication meets them on a real group): the
		// messages as MySQL 9.7 sends them.
		{&mysql.MySQLError{Number: 3101, Message: "Plugin instructed the server to rollback the current transaction."}, sqlerr.Deadlock},
		{&mysql.MySQLError{Number: 1180, Message: "Got error 149 - 'Lock deadlock; Retry transaction' during COMMIT"}, sqlerr.Deadlock},
		{&mysql.MySQLError{Number: 1180, Message: "Got error 28 - 'No space left on device' during COMMIT"}, sqlerr.Other},
	} {
		if got := sqlerr.Classify(tc.err); got != tc.want {
			t.Errorf("Classify(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}
