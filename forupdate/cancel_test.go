package forupdate_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/testdb"
)

// waitBlocked waits until want sessions are blocked by holder (testdb.BlockedBy),
// or fails after limit, listing the MySQL sessions that wait.
func waitBlocked(t testing.TB, admin *sql.DB, d sqllock.Dialect, holder int64, want int, limit time.Duration) time.Duration {
	t.Helper()
	ctx := testdb.Context(t, limit+30*time.Second)
	start := time.Now()
	for {
		n, err := testdb.BlockedBy(ctx, admin, d, holder)
		if err != nil {
			t.Fatal(err)
		}
		if n == want {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			if d == sqllock.MySQL {
				logWaiting(ctx, t, admin)
			}
			t.Fatalf("%d sessions blocked by the holder after %v, want %d", n, limit, want)
		}
		// Polling the server, which sends no signal. InnoDB refreshes the
		// information_schema lock tables only when they were not read for 100 ms.
		pause := 20 * time.Millisecond
		if d == sqllock.MySQL {
			pause = 150 * time.Millisecond
		}
		time.Sleep(pause)
	}
}

// logWaiting logs the MySQL transactions that wait for a row lock:
// information_schema.INNODB_LOCK_WAITS on MariaDB, which MySQL 8.0 replaced by
// performance_schema.data_lock_waits.
func logWaiting(ctx context.Context, t testing.TB, admin *sql.DB) {
	t.Helper()
	table, requesting := "performance_schema.data_lock_waits", "REQUESTING_ENGINE_TRANSACTION_ID"
	if f, err := testdb.FlavorOf(ctx, admin, sqllock.MySQL); err == nil && f == testdb.FlavorMariaDB {
		table, requesting = "information_schema.INNODB_LOCK_WAITS", "requesting_trx_id"
	}
	rows, err := admin.QueryContext(ctx, "SELECT r.trx_mysql_thread_id, r.trx_state, r.trx_started, r.trx_query FROM "+table+
		" w JOIN information_schema.INNODB_TRX r ON r.trx_id = w."+requesting)
	if err != nil {
		t.Log(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var a, b, c, e any
		rows.Scan(&a, &b, &c, &e)
		t.Logf("waiting: %v %s %s %s", a, b, c, e)
	}
}

// promptly bounds how long after its ctx ended an interrupted Lock may return in a
// test: room for a loaded CI machine, and half of interrupt.Grace, after which the
// waiter's connection would be broken instead.
const promptly = interrupt.Grace / 2

// TestInterruptWithFullPool: the pool has room for the holder and one waiter only,
// so interrupting the waiter cannot take a pooled connection. A waiter whose ctx
// ends (deadline or cancel) still returns promptly, and no waiter is left
// queued on the server: at once on PostgreSQL (out-of-band cancel request); on
// MySQL within the innodb_lock_wait_timeout backstop derived from the deadline
// (rounded up to 1 s).
func TestInterruptWithFullPool(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, how := range []string{"deadline", "cancel"} {
			t.Run(how, func(t *testing.T) {
				db, admin := testdb.Open(t, d), testdb.Open(t, d)
				db.SetMaxOpenConns(2)
				// No keepalive checks: they would take the connection the waiter frees.
				l := newLocker(t, db, d, forupdate.WithKeepalive(time.Hour), forupdate.WithTTL(3*time.Hour))
				name := testdb.Name(t)
				holder, err := l.Lock(testdb.Context(t, 30*time.Second), name)
				if err != nil {
					t.Fatal(err)
				}
				defer holder.Release(testdb.Context(t, 30*time.Second))

				const wait = 300 * time.Millisecond
				var ctx context.Context
				var cancel context.CancelFunc
				if how == "deadline" {
					ctx, cancel = context.WithTimeout(context.Background(), wait)
				} else {
					ctx, cancel = context.WithCancel(context.Background())
					time.AfterFunc(wait, cancel)
				}
				defer cancel()
				start := time.Now()
				res := lockAsync(ctx, l, name)
				var r lockResult
				select {
				case r = <-res:
				case <-time.After(wait + 5*time.Second):
					holder.Release(testdb.Context(t, 30*time.Second))
					<-res
					t.Fatalf("Lock still waiting 5s after its ctx ended (returned once the holder released)")
				}
				took := time.Since(start)
				lease, err := r.lease, r.err
				if err == nil {
					lease.Release(testdb.Context(t, time.Second))
					t.Fatal("acquired a held lock")
				}
				if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, ctx.Err()) {
					t.Errorf("err = %v, want ErrNotAcquired and %v", err, ctx.Err())
				}
				t.Logf("Lock returned %v after start (ctx ended at %v): %v", took, wait, err)
				if took < wait || took > wait+promptly {
					t.Errorf("Lock whose ctx ended at %v returned after %v", wait, took)
				}
				if d == sqllock.Postgres {
					// The waiter's session goes back to the pool, its connection not
					// broken: after a deadline its wait was ended by lock_timeout on the
					// server; after a cancel by a cancel request, which needs no pooled
					// connection (without one, the connection would be broken after
					// interrupt.Grace).
					if n := db.Stats().OpenConnections; n != 2 {
						t.Errorf("%d connections open after Lock returned, want 2: the waiter's connection was broken", n)
					}
				}

				if d == sqllock.MySQL && how == "cancel" {
					// No deadline, so no server-side bound: the waiter's connection was
					// broken, and the server drops the dead waiter when it is granted.
					if err := holder.Release(testdb.Context(t, 30*time.Second)); err != nil {
						t.Fatal(err)
					}
					lease, err := l.Lock(testdb.Context(t, 5*time.Second), name)
					if err != nil {
						t.Fatalf("Lock after the holder released: %v", err)
					}
					lease.Release(testdb.Context(t, 30*time.Second))
					return
				}
				gone := waitBlocked(t, admin, d, holder.SessionID(), 0, 2*time.Second)
				t.Logf("no waiter left on the server %v after Lock returned", gone)
				if n := db.Stats().InUse; n != 1 {
					t.Errorf("%d connections in use, want 1 (the holder)", n)
				}
			})
		}
	})
}

// skewedCtx reports a deadline that has passed while its Done channel is not closed
// yet, as a real context does between its deadline and the moment its timer fires.
type skewedCtx struct {
	context.Context
	deadline time.Time
}

func (c skewedCtx) Deadline() (time.Time, bool) { return c.deadline, true }

// TestDeadlineAlmostReached: Lock with less than a millisecond left before the
// deadline returns an error matching both ErrNotAcquired and DeadlineExceeded.
func TestDeadlineAlmostReached(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.Open(t, d)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		holder, err := l.Lock(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Release(testdb.Context(t, 30*time.Second))
		// An idle connection for the waiter: dialling would fail on the past deadline
		// before the wait is reached.
		if err := db.PingContext(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
		inner, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		ctx := skewedCtx{inner, time.Now()}
		lease, err := l.Lock(ctx, name)
		if err == nil {
			lease.Release(ctx)
			t.Fatal("acquired a held lock")
		}
		if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("err = %v, want ErrNotAcquired and DeadlineExceeded", err)
		}
	})
}

// TestCancelledWaitersLeaveNothingQueued: 50 waiters, one after the other, whose
// ctx ends (a deadline, or a cancel) while they wait for a held lock: each returns
// within its ctx, and none is left queued on the server (pg_blocking_pids;
// performance_schema.data_lock_waits on MySQL, information_schema.INNODB_LOCK_WAITS
// on MariaDB), so none can be granted the lock later.
func TestCancelledWaitersLeaveNothingQueued(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		l := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 2*time.Minute)
		holder, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Release(ctx)
		const wait = 100 * time.Millisecond
		var worst time.Duration
		for i := 0; i < 50; i++ {
			wctx, cancel := context.WithTimeout(ctx, wait)
			if i%2 == 1 {
				cancel()
				wctx, cancel = context.WithCancel(ctx)
				time.AfterFunc(wait, cancel)
			}
			start := time.Now()
			lease, err := l.Lock(wctx, name)
			took := time.Since(start)
			cancel()
			if err == nil {
				lease.Release(ctx)
				t.Fatalf("waiter %d acquired a held lock", i)
			}
			if !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Fatalf("waiter %d: %v", i, err)
			}
			if took > wait+time.Second {
				t.Errorf("waiter %d returned %v after its ctx ended", i, took-wait)
			}
			// Nothing of the waiter is queued on the server any more (the server's lock
			// tables lag a little behind: look until they agree, a few seconds at most).
			begin := time.Now()
			for {
				n, err := testdb.BlockedBy(ctx, admin, d, holder.SessionID())
				if err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
				if time.Since(begin) > 3*time.Second {
					t.Fatalf("waiter %d: %d sessions still queued behind the holder 3s after it returned", i, n)
				}
				time.Sleep(20 * time.Millisecond) // polling the server: it sends no signal
			}
			worst = max(worst, time.Since(begin))
		}
		t.Logf("50 abandoned waits; the server's queue was empty at most %v after each returned", worst.Round(time.Millisecond))
		if err := holder.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// holdTableLock makes the lock table wait for a DDL statement under way, as an
// ALTER TABLE would: LOCK TABLES ... WRITE on MySQL (an exclusive metadata lock),
// LOCK TABLE ... IN ACCESS EXCLUSIVE MODE in a transaction on PostgreSQL, on a
// session of admin's. It returns that session's id and the function that gives the
// table back (also run at cleanup).
func holdTableLock(t testing.TB, admin *sql.DB, d sqllock.Dialect) (sid int64, unlock func()) {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	conn, err := admin.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sid = testdb.SessionID(ctx, t, d, conn)
	lock, undo := "LOCK TABLES sqllock_rowlock WRITE", "UNLOCK TABLES"
	if d == sqllock.Postgres {
		if _, err := conn.ExecContext(ctx, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		lock, undo = "LOCK TABLE sqllock_rowlock IN ACCESS EXCLUSIVE MODE", "ROLLBACK"
	}
	if _, err := conn.ExecContext(ctx, lock); err != nil {
		t.Fatal(err)
	}
	var once bool
	unlock = func() {
		if once {
			return
		}
		once = true
		if _, err := conn.ExecContext(testdb.Context(t, 30*time.Second), undo); err != nil {
			t.Error(err)
		}
		conn.Close()
	}
	t.Cleanup(unlock)
	return sid, unlock
}

// tableLockWaiters is testdb.TableLockWaiters, failing the test on error.
func tableLockWaiters(ctx context.Context, t testing.TB, admin *sql.DB, d sqllock.Dialect, holder int64) int {
	t.Helper()
	n, err := testdb.TableLockWaiters(ctx, admin, d, holder)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestDeadlineBoundsTableLockWait: while a DDL statement holds the lock table (a
// metadata lock on MySQL, an ACCESS EXCLUSIVE lock on PostgreSQL), Lock with a
// ctx deadline waits for it like any statement (on MySQL 8 and later with a token,
// the REPLACE ... NOWAIT try is the statement that waits: NOWAIT skips only row
// locks), and returns once the deadline has passed: promptly on MySQL (KILL QUERY at
// the deadline), interrupt.ServerBoundGrace later on PostgreSQL (the statement sets
// its lock_timeout only once it has the table, so the client's cancel request ends
// that wait), with nothing of it left waiting on the server; once the table is
// given back, Lock takes the lock. The schema is the test's own: the table lock must
// not hold up the tests of other packages sharing the server.
func TestDeadlineBoundsTableLockWait(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, token := range []bool{true, false} {
			t.Run(map[bool]string{true: "token", false: "WithoutToken"}[token], func(t *testing.T) {
				ctx := testdb.Context(t, time.Minute)
				db := testdb.OpenIsolatedMigrated(ctx, t, d)
				var opts []forupdate.Option
				if !token {
					opts = append(opts, forupdate.WithoutToken())
				}
				l := newLocker(t, db, d, opts...)
				name := testdb.Name(t)
				// The first acquisition creates the name's row.
				lease, err := l.Lock(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				if err := lease.Release(ctx); err != nil {
					t.Fatal(err)
				}
				holder, unlock := holdTableLock(t, db, d)

				const wait = time.Second
				limit := promptly
				if d == sqllock.Postgres {
					limit += interrupt.ServerBoundGrace
				}
				wctx, cancel := context.WithTimeout(context.Background(), wait)
				defer cancel()
				deadline, _ := wctx.Deadline()
				res := lockAsync(wctx, l, name)
				// Whatever fails below, the waiter is ended and whatever it got given back.
				done := false
				defer func() {
					if done {
						return
					}
					cancel()
					if r := <-res; r.err == nil {
						r.lease.Release(context.Background())
					}
				}()
				// The waiter waits for the table lock.
				for tableLockWaiters(ctx, t, db, d, holder) != 1 {
					select {
					case r := <-res:
						done = true
						if r.err == nil {
							r.lease.Release(ctx)
						}
						t.Fatalf("Lock returned before it waited for the table lock: %v", r.err)
					case <-time.After(10 * time.Millisecond): // polling the server: it sends no signal
					}
					if time.Now().After(deadline) {
						t.Fatal("the waiter was not seen waiting for the table lock before its deadline")
					}
				}
				var r lockResult
				select {
				case r = <-res:
				case <-time.After(wait + 10*time.Second):
					t.Fatal("Lock still waiting 10s after its deadline")
				}
				done = true
				returned := time.Now()
				if r.err == nil {
					r.lease.Release(ctx)
					t.Fatal("acquired the lock while the table was locked")
				}
				if !errors.Is(r.err, sqllock.ErrNotAcquired) || !errors.Is(r.err, context.DeadlineExceeded) {
					t.Errorf("err = %v, want ErrNotAcquired and DeadlineExceeded", r.err)
				}
				late := returned.Sub(deadline)
				t.Logf("Lock returned %v after its deadline: %v", late, r.err)
				if late < 0 || late > limit {
					t.Errorf("Lock returned %v after its deadline, want within %v", late, limit)
				}
				// Nothing of the waiter is left waiting on the server.
				for tableLockWaiters(ctx, t, db, d, holder) != 0 {
					if time.Since(returned) > 2*time.Second {
						t.Fatal("a session still waits for the table lock 2s after Lock returned")
					}
					time.Sleep(10 * time.Millisecond) // polling the server: it sends no signal
				}
				unlock()
				lease, err = l.Lock(ctx, name)
				if err != nil {
					t.Fatalf("Lock once the table was given back: %v", err)
				}
				if err := lease.Release(ctx); err != nil {
					t.Fatal(err)
				}
			})
		}
	})
}
