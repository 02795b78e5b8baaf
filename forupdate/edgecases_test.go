package forupdate_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/testdb"
)

// TestTryAcquireAnyLeavesOthersFree: a TryAcquireAny lease holds one name only. The
// other names of its list, including never-used ones whose keys sort below and above
// a name whose row exists, can be taken at once by TryLock and Lock (on MySQL at
// REPEATABLE READ a locking read that probes a missing key gap-locks it).
func TestTryAcquireAnyLeavesOthersFree(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, level := range []sql.IsolationLevel{sql.LevelDefault, sql.LevelRepeatableRead} {
			t.Run(level.String(), func(t *testing.T) {
				l := newLocker(t, testdb.Open(t, d), d, forupdate.WithIsolation(level))
				other := newLocker(t, testdb.Open(t, d), d, forupdate.WithIsolation(level))
				ctx := testdb.Context(t, 30*time.Second)
				used := testdb.Name(t, "used")
				lease, err := l.Lock(ctx, used) // creates its row
				if err != nil {
					t.Fatal(err)
				}
				lease.Release(ctx)
				var below, above string
				for i := 0; below == "" || above == ""; i++ {
					n := testdb.Name(t, fmt.Sprint("new", i))
					if bytes.Compare(sqllockKey(n), sqllockKey(used)) < 0 {
						if below == "" {
							below = n
						}
					} else if above == "" {
						above = n
					}
				}
				names := []string{used, below, above}
				got, err := l.TryAcquireAny(ctx, names)
				if err != nil {
					t.Fatalf("TryAcquireAny: %v", err)
				}
				defer got.Release(ctx)
				for _, n := range names {
					if n == got.Name() {
						continue
					}
					lease, err := other.TryLock(ctx, n)
					if err != nil {
						t.Errorf("TryLock(%q) while TryAcquireAny holds %q: %v", n, got.Name(), err)
					} else {
						lease.Release(ctx)
					}
					wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
					start := time.Now()
					lease, err = other.Lock(wctx, n)
					took := time.Since(start)
					cancel()
					if err != nil {
						t.Errorf("Lock(%q) while TryAcquireAny holds %q: %v after %v", n, got.Name(), err, took)
						continue
					}
					lease.Release(ctx)
					if took > time.Second {
						t.Errorf("Lock(%q) of a free name took %v", n, took)
					}
				}
			})
		}
	})
}

// TestReleaseDuringKeepaliveCheck: the pool is full, so the lease's keepalive check
// waits for a connection; Release commits without waiting for that check.
func TestReleaseDuringKeepaliveCheck(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.Open(t, d)
		db.SetMaxOpenConns(2)
		const interval = 2 * time.Second
		l := newLocker(t, db, d, forupdate.WithKeepalive(interval))
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Lock(ctx, testdb.Name(t))
		if err != nil {
			t.Fatal(err)
		}
		pinned, err := db.Conn(ctx) // the pool is full now
		if err != nil {
			t.Fatal(err)
		}
		defer pinned.Close()
		waits := db.Stats().WaitCount
		for db.Stats().WaitCount == waits { // the keepalive check queues for a connection
			select {
			case <-ctx.Done():
				t.Fatal("no keepalive check")
			case <-time.After(10 * time.Millisecond):
			}
		}
		start := time.Now()
		if err := lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > interval/2 {
			t.Errorf("Release took %v: it waited for the keepalive check", took)
		}
	})
}

// TestReleaseAfterCtxEnded: Release commits even when its ctx has ended.
func TestReleaseAfterCtxEnded(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db, other := testdb.Open(t, d), testdb.Open(t, d)
		ensureData(t, other)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, lease.Tx(), d, name, 5); err != nil {
			t.Fatal(err)
		}
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		if err := lease.Release(ended); err != nil {
			t.Errorf("Release with an ended ctx: %v", err)
		}
		if v := readData(t, other, d, name); v != 5 {
			t.Errorf("write reads %d after Release, want 5", v)
		}
		if err := lease.Err(); !errors.Is(err, sqllock.ErrNotHeld) {
			t.Errorf("Err after Release = %v, want ErrNotHeld", err)
		}
		if tok := committedToken(t, other, d, name); tok != lease.Token() {
			t.Errorf("committed token %d, want %d", tok, lease.Token())
		}
	})
}

// lockWaitSetting returns the lock wait timeout in force in tx and the session
// default seen on a fresh pooled connection of db.
func lockWaitSetting(t testing.TB, ctx context.Context, db *sql.DB, tx *sql.Tx, d sqllock.Dialect) (inTx, def string) {
	t.Helper()
	q := "SELECT current_setting('lock_timeout')"
	if d == sqllock.MySQL {
		q = "SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS CHAR)"
	}
	if err := tx.QueryRowContext(ctx, q).Scan(&inTx); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, q).Scan(&def); err != nil {
		t.Fatal(err)
	}
	return inTx, def
}

// TestWithoutToken: a Locker WithoutToken excludes, honours deadlines, commits the
// work with the lock, and reports token 0. Both forms leave the session's lock wait
// timeout as it was for the work done in the lease after a deadline-bound wait.
func TestWithoutToken(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, noToken := range []bool{false, true} {
			t.Run(fmt.Sprintf("without=%v", noToken), func(t *testing.T) {
				db, admin := testdb.Open(t, d), testdb.Open(t, d)
				ensureData(t, admin)
				var opts []forupdate.Option
				if noToken {
					opts = append(opts, forupdate.WithoutToken())
				}
				l := newLocker(t, db, d, opts...)
				other := newLocker(t, testdb.Open(t, d), d)
				name := testdb.Name(t)
				ctx := testdb.Context(t, 30*time.Second) // a deadline: the bounded wait
				lease, err := l.Lock(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				if noToken != (lease.Token() == 0) {
					t.Errorf("Token() = %d", lease.Token())
				}
				inTx, def := lockWaitSetting(t, ctx, db, lease.Tx(), d)
				if inTx != def {
					t.Errorf("lock wait timeout in the lease is %q, want the session's %q", inTx, def)
				}
				if l, err := other.TryLock(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
					if l != nil {
						l.Release(ctx)
					}
					t.Errorf("TryLock of a held name: %v", err)
				}
				wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
				start := time.Now()
				_, err = l.Lock(wctx, name)
				cancel()
				if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Lock of a held name with a deadline: %v", err)
				}
				// Ending the server's wait takes a pooled connection and a KILL QUERY on
				// MySQL: some slack for a loaded machine; without it, Lock would wait for
				// the holder.
				if took := time.Since(start); took > time.Second {
					t.Errorf("Lock with a 300ms deadline returned after %v", took)
				}
				if err := insertData(ctx, lease.Tx(), d, name, 9); err != nil {
					t.Fatal(err)
				}
				if err := lease.Release(ctx); err != nil {
					t.Fatal(err)
				}
				if v := readData(t, admin, d, name); v != 9 {
					t.Errorf("write reads %d, want 9", v)
				}
				any, err := l.TryAcquireAny(ctx, []string{name, testdb.Name(t)})
				if err != nil {
					t.Fatal(err)
				}
				if noToken != (any.Token() == 0) {
					t.Errorf("TryAcquireAny Token() = %d", any.Token())
				}
				any.Release(ctx)
			})
		}
	})
}
