package advisory_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestSessionSettingsPutBack: the bound a lock sets on its session (idle and TCP
// timeouts) is put back to the session's own values when the lock is released, so
// the connection returns to the application's pool as it was taken. The session
// here starts with non-default values (startup parameters on PostgreSQL, SETs on
// connect on MySQL), which a reset to the server's defaults would lose.
func TestSessionSettingsPutBack(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		var db *sql.DB
		var vars [2]string
		var want [2]string
		if d == sqllock.Postgres {
			cfg, err := pgx.ParseConfig(testdb.DSN(t, d))
			if err != nil {
				t.Fatal(err)
			}
			cfg.RuntimeParams["idle_session_timeout"] = "3600000"
			cfg.RuntimeParams["tcp_user_timeout"] = "4321"
			db = stdlib.OpenDB(*cfg)
			vars = [2]string{"current_setting('idle_session_timeout')", "current_setting('tcp_user_timeout')"}
			want = [2]string{"1h", "4321"}
		} else {
			cfg, err := mysql.ParseDSN(testdb.DSN(t, d))
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Params == nil {
				cfg.Params = map[string]string{}
			}
			cfg.Params["wait_timeout"] = "1234"
			cfg.Params["net_write_timeout"] = "77"
			db, err = sql.Open("mysql", cfg.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			vars = [2]string{"@@session.wait_timeout", "@@session.net_write_timeout"}
			want = [2]string{"1234", "77"}
		}
		t.Cleanup(func() { db.Close() })
		db.SetMaxOpenConns(1) // the lock's session is the one looked at afterwards
		ctx := testdb.Context(t, time.Minute)
		l := newLocker(t, db, d)
		for _, wait := range []bool{false, true} {
			var lease sqllock.Lease
			var err error
			if wait {
				lease, err = l.Acquire(ctx, testdb.Name(t))
			} else {
				lease, err = l.TryAcquire(ctx, testdb.Name(t))
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := lease.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		l.Close() // returns the sessions it keeps configured for reuse
		var got [2]string
		if err := db.QueryRowContext(ctx, "SELECT "+vars[0]+", "+vars[1]).Scan(&got[0], &got[1]); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("session settings after Release = %v, want %v", got, want)
		}
	})
}
