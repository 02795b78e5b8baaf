package uniqueindex

import (
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/testdb"
)

// lockTimeoutSQL returns a statement that makes lock waits of its session fail fast
// with a lock wait timeout (55P03 / 1205), a transient error.
func lockTimeoutSQL(t testing.TB, db *sql.DB, d sqllock.Dialect, local bool) string {
	t.Helper()
	if d == sqllock.Postgres {
		if local {
			return "SET LOCAL lock_timeout = '100ms'"
		}
		return "SET lock_timeout = '100ms'"
	}
	var v string
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second), "SELECT VERSION()").Scan(&v); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(v, "MariaDB") {
		return "SET SESSION innodb_lock_wait_timeout = 0" // MariaDB: fail at once
	}
	return "SET SESSION innodb_lock_wait_timeout = 1" // MySQL's minimum
}

// blockRow locks the lease row of name FOR UPDATE in a new transaction of admin, as a
// statement in flight on that row would, until the returned function ends it.
func blockRow(t *testing.T, admin *sql.DB, d sqllock.Dialect, name string) (unblock func()) {
	t.Helper()
	tx, err := admin.BeginTx(testdb.Context(t, time.Minute), nil)
	if err != nil {
		t.Fatal(err)
	}
	var one int
	if err := tx.QueryRow(testdb.Rebind(d, "SELECT 1 FROM sqllock_lease WHERE lock_key = ? FOR UPDATE"), namekey.Key(name)).Scan(&one); err != nil {
		tx.Rollback()
		t.Fatal(err)
	}
	done := false
	t.Cleanup(func() {
		if !done {
			tx.Rollback()
		}
	})
	return func() {
		done = true
		if err := tx.Commit(); err != nil {
			t.Error(err)
		}
	}
}

// TestTransientErrors: deadlocks, serialization failures and lock wait timeouts never
// reach the caller raw. Refresh and Release retry them with a short backoff and
// succeed once the conflict is gone; a Release that still cannot delete the row
// returns a *sqllock.Error wrapping the cause, ends the lease, and the row expires by
// its TTL. Check, which runs in the caller's transaction, returns the error wrapped
// (matching the cause, not ErrLost) for the caller to retry its transaction. A lock
// wait timeout (short lock timeout, row locked by another transaction) stands for the
// whole class: the code paths are the same.
func TestTransientErrors(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		// One connection whose lock waits time out quickly: the session setting sticks.
		db := testdb.Open(t, d)
		db.SetMaxOpenConns(1)
		if _, err := db.ExecContext(testdb.Context(t, 30*time.Second), lockTimeoutSQL(t, db, d, false)); err != nil {
			t.Fatal(err)
		}
		retried := map[string]chan struct{}{"keepalive": make(chan struct{}, 1), "release": make(chan struct{}, 1)}
		// The first retry of each of those waits until the test freed the row: the
		// retries' backoff is short, and the commit that frees the row may take longer
		// on a loaded machine (CI once saw every retry of a Release time out first).
		freed := map[string]chan struct{}{"keepalive": make(chan struct{}), "release": make(chan struct{})}
		counts := make(chan string, 100)
		a := newLocker(t, db, d)
		a.onTransient = func(op string, err error) {
			if !sqlerr.Transient(err) {
				t.Errorf("%s retried a non-transient error: %v", op, err)
			}
			select {
			case counts <- op:
			default:
				t.Errorf("more than %d transient errors", cap(counts))
			}
			select {
			case retried[op] <- struct{}{}:
				select {
				case <-freed[op]:
				case <-time.After(time.Minute):
				}
			default:
			}
		}
		b := newLocker(t, testdb.Open(t, d), d, WithPollInterval(100*time.Millisecond))
		ctx := testdb.Context(t, 2*time.Minute)

		waitRetry := func(op string) {
			t.Helper()
			select {
			case <-retried[op]:
			case <-ctx.Done():
				t.Fatalf("%s: no transient error retried", op)
			}
		}

		// Refresh and Release: the first attempt meets a locked row, a retry succeeds
		// once the row is free again.
		name := testdb.Name(t)
		sl, err := a.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		lease := sl.(*Lease)
		for _, op := range []string{"keepalive", "release"} {
			unblock := blockRow(t, admin, d, name)
			res := make(chan error, 1)
			go func() {
				if op == "keepalive" { // Refresh runs one keep-alive
					res <- lease.Refresh(ctx)
				} else {
					res <- lease.Release(ctx)
				}
			}()
			waitRetry(op)
			unblock()
			close(freed[op])
			if err := <-res; err != nil {
				t.Fatalf("%s after a transient error: %v", op, err)
			}
		}
		if l, err := b.TryAcquire(ctx, name); err != nil {
			t.Fatalf("after the retried Release: %v", err)
		} else {
			l.Release(ctx)
		}

		// Release that cannot delete: bounded attempts, a wrapped error, the lease
		// ends, and the row expires by its TTL.
		const ttl = 2 * time.Second
		name2 := testdb.Name(t)
		lease2, err := a.Acquire(ctx, name2, sqllock.WithLeaseTTL(ttl))
		if err != nil {
			t.Fatal(err)
		}
		for len(counts) > 0 {
			<-counts
		}
		unblock := blockRow(t, admin, d, name2)
		err = lease2.Release(ctx)
		var se *sqllock.Error
		switch {
		case err == nil:
			t.Fatal("Release succeeded while its row was locked")
		case !errors.As(err, &se) || se.Op != "release":
			t.Errorf("Release error %T %v, want a *sqllock.Error of op release", err, err)
		case !sqlerr.Transient(err) || !strings.Contains(err.Error(), "expires"):
			t.Errorf("Release error %v should wrap the transient cause and say the row expires", err)
		}
		n := 0
	drain:
		for {
			select {
			case op := <-counts:
				if op == "release" {
					n++
				}
			default:
				break drain
			}
		}
		if n != wait.MaxTransient-1 {
			t.Errorf("Release retried %d times, want %d", n, wait.MaxTransient-1)
		}
		select {
		case <-lease2.Done():
		default:
			t.Error("lease not ended after the failed Release")
		}
		t.Logf("failed Release after %d attempts: %v", n+1, err)
		unblock()
		start := time.Now()
		l2, err := b.Acquire(ctx, name2)
		if err != nil {
			t.Fatalf("the row left by the failed Release did not expire: %v", err)
		}
		t.Logf("row left by the failed Release taken over after %v (TTL %v)", time.Since(start).Round(time.Millisecond), ttl)

		// Check in a transaction of the caller: wrapped, matching the cause.
		unblock = blockRow(t, admin, d, name2)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, lockTimeoutSQL(t, admin, d, true)); err != nil {
			t.Fatal(err)
		}
		err = l2.(*Lease).Check(ctx, tx)
		tx.Rollback()
		unblock()
		switch {
		case !errors.As(err, &se) || se.Op != "check":
			t.Errorf("Check error %T %v, want a *sqllock.Error of op check", err, err)
		case !sqlerr.Is(err, sqlerr.LockTimeout):
			t.Errorf("Check error %v does not match its lock wait timeout cause", err)
		case errors.Is(err, sqllock.ErrLost):
			t.Errorf("Check error %v matches ErrLost, but the lease is current", err)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}
