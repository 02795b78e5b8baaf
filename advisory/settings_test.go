package advisory_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
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

// TestKeptSessionsKeepTheBound: a PostgreSQL Locker that takes locks back to back
// keeps its sessions for a moment with their bound still set, and its lock and unlock
// statements on them leave the settings alone. The bound must hold all the same: a
// holder on such a session that is cut off by the network loses the lock on the server
// within the TTL. Afterwards, Close puts the settings of the kept sessions back.
func TestKeptSessionsKeepTheBound(t *testing.T) {
	const d = sqllock.Postgres
	const ttl = 2 * time.Second
	ctx := testdb.Context(t, time.Minute)
	db, proxy := testdb.OpenProxied(t, d)
	admin := testdb.Open(t, d)
	l := newLocker(t, db, d, advisory.WithTTL(ttl), advisory.WithKeepalive(500*time.Millisecond))
	name := testdb.Name(t)
	for range 3 { // back to back: the Locker keeps the session from the second on
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	held, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	sid := held.(*advisory.Lease).SessionID()
	var last string
	if err := admin.QueryRowContext(ctx, "SELECT query FROM pg_stat_activity WHERE pid = $1", sid).Scan(&last); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(last, "idle_session_timeout") {
		t.Fatalf("the lock statement on a kept session set the bound again: %s", last)
	}
	proxy.Partition()
	start := time.Now()
	other := newLocker(t, testdb.Open(t, d), d)
	octx, cancel := context.WithTimeout(ctx, ttl+3*time.Second)
	defer cancel()
	le, err := other.Acquire(octx, name)
	if err != nil {
		t.Fatalf("the lock of a partitioned holder on a kept session was not freed within %v: %v", ttl+3*time.Second, err)
	}
	t.Logf("freed %v after the partition", time.Since(start).Round(time.Millisecond))
	le.Release(ctx)
	proxy.Heal()
	<-held.Done()
	held.Release(ctx)

	// A kept session's settings are put back when the Locker gives it back.
	direct := testdb.Open(t, d)
	dl := newLocker(t, direct, d)
	for range 3 {
		le, err := dl.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	dl.Close()
	var wantIdle, wantTCP string // a session that never took a lock
	if err := admin.QueryRowContext(ctx, "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout')").Scan(&wantIdle, &wantTCP); err != nil {
		t.Fatal(err)
	}
	n := direct.Stats().OpenConnections
	conns := make([]*sql.Conn, n)
	for i := range conns { // every session of the pool, held at once
		if conns[i], err = direct.Conn(ctx); err != nil {
			t.Fatal(err)
		}
		defer conns[i].Close()
		var idle, tcp string
		if err := conns[i].QueryRowContext(ctx, "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout')").Scan(&idle, &tcp); err != nil {
			t.Fatal(err)
		}
		if idle != wantIdle || tcp != wantTCP {
			t.Errorf("session %d of %d back in the pool with idle_session_timeout %s, tcp_user_timeout %s; want %s, %s", i, n, idle, tcp, wantIdle, wantTCP)
		}
	}
}
