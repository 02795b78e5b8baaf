package direct_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/direct"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) {
	os.Exit(testdb.MainLeakFree(m))
}

// openConn returns a new pool and a connection of it, closed at the end of the test.
func openConn(t *testing.T, d sqllock.Dialect) (*sql.DB, *sql.Conn) {
	t.Helper()
	db := testdb.Open(t, d)
	conn, err := db.Conn(testdb.Context(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return db, conn
}

// TestRow: a row scans into *bool, *int64 and sql.Scanners, NULL into a Null type is
// not valid and into an *int64 an error, no row is sql.ErrNoRows (Exists: false).
func TestRow(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		_, conn := openConn(t, d)
		ctx := testdb.Context(t, 30*time.Second)
		var (
			b  bool
			n  int64
			s  sql.NullString
			nn sql.NullInt64
		)
		q := "SELECT 1 = 1, 42, 'x', NULL"
		if err := direct.Row(ctx, conn, q, nil, &b, &n, &s, &nn); err != nil {
			t.Fatal(err)
		}
		if !b || n != 42 || s.String != "x" || !s.Valid || nn.Valid {
			t.Fatalf("scanned %v %v %v %v", b, n, s, nn)
		}
		if err := direct.Row(ctx, conn, "SELECT NULL", nil, &n); err == nil {
			t.Fatal("NULL into an *int64: no error")
		}
		none := "SELECT 1 WHERE 1 = 0"
		if err := direct.Row(ctx, conn, none, nil, &n); !errors.Is(err, sql.ErrNoRows) {
			t.Fatalf("no row: %v, want sql.ErrNoRows", err)
		}
		if ok, err := direct.Exists(ctx, conn, none, nil); ok || err != nil {
			t.Fatalf("Exists of no row = %v, %v", ok, err)
		}
		if ok, err := direct.Exists(ctx, conn, "SELECT 1", nil); !ok || err != nil {
			t.Fatalf("Exists of a row = %v, %v", ok, err)
		}
		if d == sqllock.Postgres {
			if err := direct.Row(ctx, conn, "SELECT $1::int8 + $2::int4", direct.Args(int64(40), int32(2)), &n); err != nil || n != 42 {
				t.Fatalf("with arguments: %v, %v", n, err)
			}
		}
	})
}

// TestStmt: a statement prepared on a connection runs there with its arguments, and
// closes.
func TestStmt(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		_, conn := openConn(t, d)
		ctx := testdb.Context(t, 30*time.Second)
		q := testdb.Rebind(d, "SELECT CAST(? AS CHAR(10)), 1")
		if d == sqllock.Postgres {
			q = "SELECT $1::text, 1"
		}
		st, err := direct.Prepare(ctx, conn, q)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range []string{"a", "b"} {
			var s sql.NullString
			if err := st.Row(ctx, conn, direct.Args(v), &s); err != nil || s.String != v {
				t.Fatalf("Row(%q) = %q, %v", v, s.String, err)
			}
		}
		if err := st.Close(conn); err != nil {
			t.Fatal(err)
		}
	})
}

// TestBounded: a statement still ends with its context (the driver's own watch),
// and the connection it broke is not handed out again.
func TestBounded(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db, conn := openConn(t, d)
		db.SetMaxIdleConns(1)
		ctx := testdb.Context(t, 30*time.Second)
		q := "SELECT SLEEP(10)"
		if d == sqllock.Postgres {
			q = "SELECT 1 FROM pg_sleep(10)"
		}
		qctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := direct.Row(qctx, conn, q, nil, new(sql.NullInt64))
		if took := time.Since(start); err == nil || took > 5*time.Second {
			t.Fatalf("a 10 s statement under a 200 ms context: %v after %v", err, took)
		}
		conn.Close()
		// The session is usable or gone, never stuck in the sleep.
		var one int64
		if err := db.QueryRowContext(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
			t.Fatalf("the pool after a cancelled statement: %v", err)
		}
	})
}
