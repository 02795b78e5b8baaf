package sqlerr_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

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

		// A session killed by the server.
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		var id int64
		idQ, killQ := "SELECT pg_backend_pid()", "SELECT pg_terminate_backend(%d)"
		if d == sqllock.MySQL {
			// KILL takes no placeholder on MySQL (6413).
			idQ, killQ = "SELECT CONNECTION_ID()", "KILL %d"
		}
		if err := conn.QueryRowContext(ctx, idQ).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.ExecContext(ctx, fmt.Sprintf(killQ, id)); err != nil {
			t.Fatal(err)
		}
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
	} {
		if got := sqlerr.Classify(tc.err); got != tc.want {
			t.Errorf("Classify(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}
