package direct_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"os"
	"sync/atomic"
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
// not valid and into an *int64 an error, no row is sql.ErrNoRows.
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
		if err := direct.Row(ctx, conn, "SELECT 1", nil); err != nil {
			t.Fatalf("a row, no destination: %v", err)
		}
		if d == sqllock.Postgres {
			if err := direct.Row(ctx, conn, "SELECT $1::int8 + $2::int4", []any{int64(40), int32(2)}, &n); err != nil || n != 42 {
				t.Fatalf("with arguments: %v, %v", n, err)
			}
		}
		n = 0
		if err := direct.Row(ctx, conn, "SELECT 42, 'x'", nil, &n); err != nil || n != 42 {
			t.Fatalf("fewer destinations than columns: %v, %v", n, err)
		}
		if err := direct.Row(ctx, conn, "SELECT 42", nil, &n, &s); err == nil {
			t.Fatal("more destinations than columns: no error")
		}
		if err := direct.Row(ctx, conn, "SELECT NULL", nil, &b); err == nil {
			t.Fatal("NULL into a *bool: no error")
		}
		// The connection is still usable after each of those errors.
		if err := direct.Row(ctx, conn, "SELECT 7", nil, &n); err != nil || n != 7 {
			t.Fatalf("after the errors: %v, %v", n, err)
		}
	})
}

// TestThroughWrappers: a driver wrapping pgx's (tracing, counting) sees every
// statement run directly: only pgx's own driver connection is bypassed.
func TestThroughWrappers(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		var sent atomic.Int64
		db := testdb.OpenCounting(t, d, &sent)
		ctx := testdb.Context(t, 30*time.Second)
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		sent.Store(0)
		var n int64
		for range 3 {
			if err := direct.Row(ctx, conn, "SELECT 42", nil, &n); err != nil || n != 42 {
				t.Fatalf("through the wrapper: %v, %v", n, err)
			}
		}
		if got := sent.Load(); got != 3 {
			t.Fatalf("the wrapper saw %d statements, want 3", got)
		}
	})
}

// TestKilledSession: a statement on a session the server ended fails, and the pool
// does not hand that connection out again.
func TestKilledSession(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db, conn := openConn(t, d)
		ctx := testdb.Context(t, 30*time.Second)
		var sid int64
		q := "SELECT CONNECTION_ID()"
		if d == sqllock.Postgres {
			q = "SELECT pg_backend_pid()"
		}
		if err := direct.Row(ctx, conn, q, nil, &sid); err != nil {
			t.Fatal(err)
		}
		testdb.Kill(ctx, t, db, d, sid)
		// Wait until the session is gone from the server's list of sessions.
		gone := "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?"
		if d == sqllock.Postgres {
			gone = "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1"
		}
		for {
			var left int64
			if err := db.QueryRowContext(ctx, gone, sid).Scan(&left); err != nil {
				t.Fatal(err)
			}
			if left == 0 {
				break
			}
			time.Sleep(10 * time.Millisecond) // no signal for a session's exit
		}
		var n int64
		if err := direct.Row(ctx, conn, "SELECT 1", nil, &n); err == nil {
			t.Fatal("a statement on a killed session: no error")
		}
		conn.Close()
		for range 3 {
			var other int64
			if err := db.QueryRowContext(ctx, q).Scan(&other); err != nil {
				t.Fatalf("the pool after a killed session: %v", err)
			}
			if other == sid {
				t.Fatalf("the pool handed out the killed session %d again", sid)
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
			if err := st.Row(ctx, conn, []any{v}, &s); err != nil || s.String != v {
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

// TestDeclined: a driver connection that can only prepare (no QueryerContext, as a
// minimal wrapping driver), and a query that go-sql-driver declines (arguments:
// driver.ErrSkip), run through database/sql, with Row's rules.
func TestDeclined(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, 30*time.Second)
		var prepared atomic.Int64
		db := testdb.OpenWrapped(t, d, func(c driver.Conn) driver.Conn {
			return prepareOnlyConn{inner: c, prepared: &prepared}
		})
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		var n int64
		if err := direct.Row(ctx, conn, "SELECT 42, 'x'", nil, &n); err != nil || n != 42 {
			t.Fatalf("fewer destinations than columns: %v, %v", n, err)
		}
		if prepared.Load() == 0 {
			t.Fatal("the query did not go through database/sql (nothing prepared)")
		}
		if err := direct.Row(ctx, conn, "SELECT 42", nil, &n, new(int64)); err == nil {
			t.Fatal("more destinations than columns: no error")
		}
		if err := direct.Row(ctx, conn, "SELECT NULL", nil, &n); err == nil {
			t.Fatal("NULL into an *int64: no error")
		}
		none := "SELECT 1 WHERE 1 = 0"
		if err := direct.Row(ctx, conn, none, nil, &n); !errors.Is(err, sql.ErrNoRows) {
			t.Fatalf("no row: %v, want sql.ErrNoRows", err)
		}
		if err := direct.Row(ctx, conn, "SELECT 1", nil); err != nil {
			t.Fatalf("a row, no destination: %v", err)
		}

		// Arguments, on a connection of the driver itself.
		plain := testdb.Open(t, d)
		pconn, err := plain.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer pconn.Close()
		q := "SELECT CAST(? AS SIGNED) + 1"
		if d == sqllock.Postgres {
			q = "SELECT $1::int8 + 1"
		}
		if err := direct.Row(ctx, pconn, q, []any{int64(41)}, &n); err != nil || n != 42 {
			t.Fatalf("with an argument: %v, %v", n, err)
		}
	})
}

// prepareOnlyConn offers only driver.Conn (Prepare, Close, Begin) of the driver's
// connection: database/sql prepares every query on it.
type prepareOnlyConn struct {
	inner    driver.Conn
	prepared *atomic.Int64
}

func (c prepareOnlyConn) Prepare(q string) (driver.Stmt, error) {
	c.prepared.Add(1)
	return c.inner.Prepare(q)
}

func (c prepareOnlyConn) Close() error { return c.inner.Close() }

func (c prepareOnlyConn) Begin() (driver.Tx, error) { return c.inner.Begin() }

// TestUnprepared: on pgx with its statement cache (the DSN's default), Row leaves the
// statement prepared on the server session and Unprepared leaves nothing
// (pg_prepared_statements), with the same arguments and result, also through a
// wrapper of pgx's driver (testdb.OpenCounting); on MySQL Unprepared is Row.
func TestUnprepared(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		_, plain := openConn(t, d)
		wrapped, err := testdb.OpenCounting(t, d, new(atomic.Int64)).Conn(testdb.Context(t, 30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { wrapped.Close() })
		for _, c := range []struct {
			name string
			conn *sql.Conn
		}{{"pgx", plain}, {"wrapped", wrapped}} {
			t.Run(c.name, func(t *testing.T) { unprepared(t, d, c.conn) })
		}
	})
}

func unprepared(t *testing.T, d sqllock.Dialect, conn *sql.Conn) {
	{
		ctx := testdb.Context(t, 30*time.Second)
		q, args := "SELECT 40 + 2", []any(nil)
		if d == sqllock.Postgres {
			q, args = "SELECT $1::int8 + $2::int4 /* unprepared */", []any{int64(40), int32(2)}
		}
		var n int64
		if err := direct.Unprepared(ctx, conn, q, args, &n); err != nil || n != 42 {
			t.Fatalf("Unprepared: %v, %v", n, err)
		}
		if d != sqllock.Postgres {
			return
		}
		prepared := func() int64 {
			var c int64
			if err := direct.Unprepared(ctx, conn, "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%/* unprepared */%'", nil, &c); err != nil {
				t.Fatal(err)
			}
			return c
		}
		if c := prepared(); c != 0 {
			t.Errorf("after Unprepared: %d prepared statements on the session; want 0", c)
		}
		if err := direct.Row(ctx, conn, q, args, &n); err != nil || n != 42 {
			t.Fatalf("Row: %v, %v", n, err)
		}
		if c := prepared(); c != 1 {
			t.Errorf("after Row: %d prepared statements on the session; want 1 (the test no longer shows the difference)", c)
		}
	}
}
