package interrupt_test

import (
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// TestReleaseDiscardEndsPoolSession: a session discarded by Release ends on the
// server, also under stdlib.OpenDBFromPool, where database/sql's close of a bad
// connection would only hand it back to the pgxpool (locks and all).
func TestReleaseDiscardEndsPoolSession(t *testing.T) {
	const d = sqllock.Postgres
	dsn := testdb.DSN(t, d) // may start the server's container: before the deadline
	ctx := testdb.Context(t, time.Minute)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const key = 7340177
	var pid int64
	if err := conn.QueryRowContext(ctx, "SELECT pg_backend_pid() FROM pg_advisory_lock($1::int8)", int64(key)).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	interrupt.Release(conn, true)

	// The backend ends once it reads the Terminate: poll pg_locks for a while.
	other := testdb.Open(t, d)
	var n int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if err := other.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1`, pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 || time.Now().After(deadline) {
			break
		}
	}
	if n != 0 {
		t.Fatalf("backend %d still holds %d advisory lock(s) after Release(discard)", pid, n)
	}
	if s := pool.Stat(); s.TotalConns() != 0 {
		t.Errorf("the pgxpool kept %d connection(s)", s.TotalConns())
	}
}
