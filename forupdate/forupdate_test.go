package forupdate_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

func newLocker(t testing.TB, db *sql.DB, d sqllock.Dialect, opts ...forupdate.Option) *forupdate.Locker {
	t.Helper()
	opts = append([]forupdate.Option{forupdate.WithKeepalive(200 * time.Millisecond)}, opts...)
	l, err := forupdate.New(db, d, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// lockResult is what a Lock run in the background returned.
type lockResult struct {
	lease *forupdate.Lease
	err   error
}

// lockAsync runs l.Lock(ctx, name) in the background and delivers what it returned.
func lockAsync(ctx context.Context, l *forupdate.Locker, name string) <-chan lockResult {
	res := make(chan lockResult, 1)
	go func() {
		lease, err := l.Lock(ctx, name)
		res <- lockResult{lease, err}
	}()
	return res
}

// kill ends the session holding lease, as an operator or a failover would.
func kill(t testing.TB, admin *sql.DB, d sqllock.Dialect, lease sqllock.Lease) {
	t.Helper()
	testdb.Kill(testdb.Context(t, 30*time.Second), t, admin, d, lease.(*forupdate.Lease).SessionID())
}

func TestLocktest(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, forupdate.WithTTL(ttl), forupdate.WithKeepalive(400*time.Millisecond))
			},
			Lose: func(t testing.TB, admin *sql.DB, lease sqllock.Lease) { kill(t, admin, d, lease) },
			// The server ends the partitioned transaction TTL after it was last
			// active; the waiter's locking read is granted at once then.
			PartitionBound: ttl + 2*time.Second, // the server's timer and a loaded CI machine: up to 2 s late
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				l, err := forupdate.New(db, d)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { l.Close() })
				return l
			},
			LatencyHold: 2*forupdate.DefaultKeepalive + time.Second,
			// Finding 15: after an operator's kill the lease reports itself held for
			// at most the default keep-alive interval plus the check.
			KillWindow: forupdate.DefaultKeepalive + 1500*time.Millisecond,
		})
	})
}

const dataTable = "sqllock_forupdate_testdata"

func ensureData(t testing.TB, db *sql.DB) {
	t.Helper()
	_, err := db.ExecContext(testdb.Context(t, 30*time.Second),
		"CREATE TABLE IF NOT EXISTS "+dataTable+" (k varchar(255) PRIMARY KEY, v bigint NOT NULL)")
	if err != nil {
		t.Logf("create %s: %v", dataTable, err) // concurrent binaries may race
	}
}

func ph(d sqllock.Dialect, n int) string {
	if d == sqllock.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

// readData reads k through db (a connection other than the lease's); -1 if absent.
func readData(t testing.TB, db *sql.DB, d sqllock.Dialect, k string) int64 {
	t.Helper()
	var v int64
	err := db.QueryRowContext(testdb.Context(t, 30*time.Second), "SELECT v FROM "+dataTable+" WHERE k = "+ph(d, 1), k).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return -1
	}
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func insertData(ctx context.Context, tx *sql.Tx, d sqllock.Dialect, k string, v int64) error {
	_, err := tx.ExecContext(ctx, "INSERT INTO "+dataTable+" (k, v) VALUES ("+ph(d, 1)+", "+ph(d, 2)+")", k, v)
	return err
}

func committedToken(t testing.TB, db *sql.DB, d sqllock.Dialect, name string) int64 {
	t.Helper()
	var tok int64
	q := "SELECT token FROM sqllock_rowlock WHERE name = " + ph(d, 1)
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second), q, []byte(name)).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestWithLockCommitsOrRollsBack: fn's write and the token commit together on
// success and are both discarded when fn fails, as seen from another connection.
func TestWithLockCommitsOrRollsBack(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db, other := testdb.Open(t, d), testdb.Open(t, d)
		ensureData(t, other)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)

		if err := l.WithLock(ctx, name, func(ctx context.Context, tx *sql.Tx) error { return nil }); err != nil {
			t.Fatal(err)
		}
		before := committedToken(t, other, d, name)

		failed := errors.New("fn failed")
		err := l.WithLock(ctx, name, func(ctx context.Context, tx *sql.Tx) error {
			if err := insertData(ctx, tx, d, name+"/fail", 1); err != nil {
				return err
			}
			if v := readData(t, other, d, name+"/fail"); v != -1 {
				t.Errorf("uncommitted write visible from another connection")
			}
			return failed
		})
		if !errors.Is(err, failed) {
			t.Fatalf("WithLock = %v, want fn's error", err)
		}
		if v := readData(t, other, d, name+"/fail"); v != -1 {
			t.Errorf("write of a failed fn was committed")
		}
		if tok := committedToken(t, other, d, name); tok != before {
			t.Errorf("token of a rolled-back acquisition committed: %d, was %d", tok, before)
		}

		var got int64
		err = l.WithLock(ctx, name, func(ctx context.Context, tx *sql.Tx) error {
			lease, _ := l.TryLock(ctx, name)
			if lease != nil {
				lease.Rollback(ctx)
				t.Error("TryLock succeeded while WithLock held the lock")
			}
			return insertData(ctx, tx, d, name+"/ok", 7)
		})
		if err != nil {
			t.Fatal(err)
		}
		if got = readData(t, other, d, name+"/ok"); got != 7 {
			t.Errorf("committed write reads %d, want 7", got)
		}
		if tok := committedToken(t, other, d, name); tok <= before {
			t.Errorf("committed token %d, not greater than %d", tok, before)
		}
		// A panicking fn rolls back and frees the lock.
		func() {
			defer func() { recover() }()
			l.WithLock(ctx, name, func(ctx context.Context, tx *sql.Tx) error { panic("boom") })
		}()
		lease, err := l.TryLock(ctx, name)
		if err != nil {
			t.Fatalf("TryLock after a panicking fn: %v", err)
		}
		lease.Release(ctx)
		l.Close() // returns the sessions it keeps for reuse (MySQL)
		if n := db.Stats().InUse; n != 0 {
			t.Errorf("%d connections in use", n)
		}
	})
}

// TestHolderKilled: the holder's session is killed while a waiter is blocked; the
// lease reports ErrLost, the waiter gets the lock, the holder's write is absent.
func TestHolderKilled(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db1, db2, admin := testdb.Open(t, d), testdb.Open(t, d), testdb.Open(t, d)
		ensureData(t, admin)
		l1, l2 := newLocker(t, db1, d), newLocker(t, db2, d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		holder, err := l1.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, holder.Tx(), d, name, 1); err != nil {
			t.Fatal(err)
		}
		res := lockAsync(ctx, l2, name)
		select {
		case r := <-res:
			t.Fatalf("waiter returned while the lock was held: %v", r.err)
		case <-time.After(300 * time.Millisecond): // the waiter is queued by then
		}
		start := time.Now()
		kill(t, admin, d, holder)
		var r lockResult
		select {
		case r = <-res:
		case <-time.After(10 * time.Second):
			t.Fatal("waiter not granted 10s after the holder's session was killed")
		}
		if r.err != nil {
			t.Fatalf("waiter: %v", r.err)
		}
		t.Logf("waiter granted %v after the kill", time.Since(start))
		select {
		case <-holder.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("holder's Done not closed 10s after its session was killed")
		}
		t.Logf("holder noticed the loss %v after the kill", time.Since(start))
		if err := holder.Err(); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("holder Err = %v, want ErrLost", err)
		}
		if err := holder.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("holder Release = %v, want ErrLost", err)
		}
		if r.lease.Token() <= holder.Token() {
			t.Errorf("waiter token %d not greater than the killed holder's %d", r.lease.Token(), holder.Token())
		}
		if v := readData(t, admin, d, name); v != -1 {
			t.Errorf("killed holder's write is present (%d)", v)
		}
		var v int64 = -1
		err = r.lease.Tx().QueryRowContext(ctx, "SELECT v FROM "+dataTable+" WHERE k = "+ph(d, 1), name).Scan(&v)
		if !errors.Is(err, sql.ErrNoRows) {
			t.Errorf("new holder reads the killed holder's write: %v, %v", v, err)
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// TestPoolNotExhausted: a pool of 10 connections, 100 goroutines waiting on one
// name. The waiter cap keeps connections free: the holder commits and an unrelated
// query completes within a second.
func TestPoolNotExhausted(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.Open(t, d)
		db.SetMaxOpenConns(10)
		// The holder's keepalive would borrow a connection now and then: keep it out
		// of the count, which is about waiters.
		l := newLocker(t, db, d, forupdate.WithMaxWaiters(4), forupdate.WithKeepalive(time.Hour), forupdate.WithTTL(3*time.Hour))
		name := testdb.Name(t)
		ctx := testdb.Context(t, 60*time.Second)
		holder, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		const waiters, slots = 100, 4
		var wg sync.WaitGroup
		var acquired atomic.Int64
		errs := make(chan error, waiters)
		for i := 0; i < waiters; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				lease, err := l.Lock(ctx, name)
				if err != nil {
					errs <- err
					return
				}
				acquired.Add(1)
				errs <- lease.Release(ctx)
			}()
		}
		// Settled: every slot taken by a waiter blocked in the database, every other
		// caller past its NOWAIT attempt and waiting in the process.
		deadline := time.Now().Add(30 * time.Second)
		for {
			inSlots, queued, inDB := l.WaitState()
			if inSlots == slots && queued == waiters-slots && inDB == slots {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("waiters did not settle: %d in slots, %d queued, %d waiting in the database", inSlots, queued, inDB)
			}
			select {
			case err := <-errs:
				t.Fatalf("a waiter returned while the lock was held: %v", err)
			case <-time.After(5 * time.Millisecond):
			}
		}
		if n := db.Stats().InUse; n > slots+1 {
			t.Errorf("%d connections in use, want at most %d waiters + 1 holder", n, slots)
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		start := time.Now()
		var one int
		err = db.QueryRowContext(qctx, "SELECT 1").Scan(&one)
		cancel()
		if err != nil {
			t.Errorf("unrelated query with 100 waiters: %v (after %v)", err, time.Since(start))
		} else {
			t.Logf("unrelated query took %v", time.Since(start))
		}
		if _, err := holder.Tx().ExecContext(ctx, "SELECT 1"); err != nil {
			t.Error(err)
		}
		start = time.Now()
		if err := holder.Release(ctx); err != nil {
			t.Errorf("holder commit: %v", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("holder commit took %v", took)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Error(err)
			}
		}
		if acquired.Load() != 100 {
			t.Errorf("%d of 100 waiters acquired", acquired.Load())
		}
	})
}

// TestSubSecondDeadline: a 300 ms deadline ends the wait promptly, and leaves no
// waiter queued on the server. On PostgreSQL the server's own bound (lock_timeout)
// ends it: within 200 ms, before the client's backstop interrupt
// (interrupt.ServerBoundGrace) would. On MySQL the client interrupts it at the
// deadline (KILL QUERY from another pooled connection, which may have to be dialled),
// beside the server's bound: on MariaDB rounded up to a whole second, which the
// limit, promptly, tells from the interrupt; on MySQL 8 and later MAX_EXECUTION_TIME,
// in milliseconds, which ends the wait at the deadline too.
func TestSubSecondDeadline(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		limit := 200 * time.Millisecond
		if d == sqllock.MySQL {
			limit = promptly
		}
		db := testdb.Open(t, d)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		holder, err := l.Lock(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 3; i++ {
			const wait = 300 * time.Millisecond
			ctx, cancel := context.WithTimeout(context.Background(), wait)
			start := time.Now()
			lease, err := l.Lock(ctx, name)
			took := time.Since(start)
			cancel()
			if err == nil {
				lease.Release(testdb.Context(t, time.Second))
				t.Fatal("acquired a held lock")
			}
			if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("err = %v", err)
			}
			t.Logf("deadline %v honoured after %v", wait, took)
			if took < wait || took > wait+limit {
				t.Errorf("Lock with a %v deadline returned after %v, want at most %v after it", wait, took, limit)
			}
		}
		holder.Release(testdb.Context(t, 30*time.Second))
		lease, err := l.TryLock(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatalf("TryLock after the timed-out waiters: %v (a waiter was left queued)", err)
		}
		lease.Release(testdb.Context(t, 30*time.Second))
	})
}

// TestIsolation: read-modify-write of a counter through the lease's transaction, by
// goroutines on two pools, under READ COMMITTED and REPEATABLE READ: every holder
// reads the previous holder's committed write.
func TestIsolation(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, level := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead} {
			t.Run(level.String(), func(t *testing.T) {
				admin := testdb.Open(t, d)
				ensureData(t, admin)
				name := testdb.Name(t)
				if _, err := admin.ExecContext(testdb.Context(t, 30*time.Second), "INSERT INTO "+dataTable+" (k, v) VALUES ("+ph(d, 1)+", 0)", name); err != nil {
					t.Fatal(err)
				}
				ls := []*forupdate.Locker{
					newLocker(t, testdb.Open(t, d), d, forupdate.WithIsolation(level)),
					newLocker(t, testdb.Open(t, d), d, forupdate.WithIsolation(level)),
				}
				ctx := testdb.Context(t, 60*time.Second)
				var wg sync.WaitGroup
				const goroutines, each = 6, 15
				errs := make(chan error, goroutines)
				for g := 0; g < goroutines; g++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := 0; i < each; i++ {
							err := ls[g%2].WithLock(ctx, name, func(ctx context.Context, tx *sql.Tx) error {
								var v int64
								if err := tx.QueryRowContext(ctx, "SELECT v FROM "+dataTable+" WHERE k = "+ph(d, 1), name).Scan(&v); err != nil {
									return err
								}
								_, err := tx.ExecContext(ctx, "UPDATE "+dataTable+" SET v = "+ph(d, 1)+" WHERE k = "+ph(d, 2), v+1, name)
								return err
							})
							if err != nil {
								errs <- err
								return
							}
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Error(err)
				}
				if v := readData(t, admin, d, name); v != goroutines*each {
					t.Errorf("counter %d after %d locked increments", v, goroutines*each)
				}
			})
		}
	})
}

func TestTryAcquireAny(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		l := newLocker(t, testdb.Open(t, d), d)
		l2 := newLocker(t, testdb.Open(t, d), d)
		ctx := testdb.Context(t, 30*time.Second)
		names := []string{testdb.Name(t, "a"), testdb.Name(t, "b"), testdb.Name(t, "c")}
		a, err := l.Lock(ctx, names[0])
		if err != nil {
			t.Fatal(err)
		}
		var got []*forupdate.Lease
		defer func() {
			for _, g := range got {
				g.Release(ctx)
			}
		}()
		seen := map[string]bool{names[0]: true}
		for i := 1; i < 3; i++ {
			lease, err := l2.TryAcquireAny(ctx, names)
			if err != nil {
				a.Release(ctx)
				t.Fatalf("TryAcquireAny %d: %v", i, err)
			}
			got = append(got, lease)
			if seen[lease.Name()] {
				t.Errorf("TryAcquireAny %d took %q, which is held", i, lease.Name())
			}
			seen[lease.Name()] = true
			if d == sqllock.Postgres && lease.Name() != names[i] {
				t.Errorf("TryAcquireAny %d took %q, want %q (the order given)", i, lease.Name(), names[i])
			}
		}
		if lease, err := l2.TryAcquireAny(ctx, names); !errors.Is(err, sqllock.ErrNotAcquired) || lease != nil {
			t.Errorf("TryAcquireAny with every name held = %v, %v", lease, err)
		}
		a.Release(ctx)
		lease, err := l2.TryAcquireAny(ctx, names)
		if err != nil || lease.Name() != names[0] {
			t.Fatalf("TryAcquireAny after release = %v, %v", lease, err)
		}
		if lease.Token() <= a.Token() {
			t.Errorf("token %d not greater than %d", lease.Token(), a.Token())
		}
		lease.Release(ctx)
	})
}

// TestConcurrentFirstUse: many clients take a new name at once; creating its row
// never deadlocks or fails.
func TestConcurrentFirstUse(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ls := []*forupdate.Locker{newLocker(t, testdb.Open(t, d), d), newLocker(t, testdb.Open(t, d), d)}
		for _, level := range []sql.IsolationLevel{sql.LevelRepeatableRead} {
			ls = append(ls, newLocker(t, testdb.Open(t, d), d, forupdate.WithIsolation(level)))
		}
		ctx := testdb.Context(t, 60*time.Second)
		for round := 0; round < 5; round++ {
			name := testdb.Name(t)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for g := 0; g < 12; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					l := ls[g%len(ls)]
					var lease *forupdate.Lease
					var err error
					if g%3 == 0 {
						lease, err = l.TryLock(ctx, name)
						if errors.Is(err, sqllock.ErrNotAcquired) {
							return
						}
					} else {
						lease, err = l.Lock(ctx, name)
					}
					if err != nil {
						t.Error(err)
						return
					}
					lease.Release(ctx)
				}()
			}
			close(start)
			wg.Wait()
		}
	})
}

func TestOptions(t *testing.T) {
	db, _ := sql.Open("mysql", "root@tcp(127.0.0.1:1)/none") // never connected
	defer db.Close()
	for _, c := range []struct {
		name string
		opts []forupdate.Option
	}{
		{"zero waiters", []forupdate.Option{forupdate.WithMaxWaiters(0)}},
		{"negative keepalive", []forupdate.Option{forupdate.WithKeepalive(-time.Second)}},
		{"nil logger", []forupdate.Option{forupdate.WithLogger(nil)}},
		{"read uncommitted", []forupdate.Option{forupdate.WithIsolation(sql.LevelReadUncommitted)}},
	} {
		if _, err := forupdate.New(db, sqllock.MySQL, c.opts...); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("%s: New = %v, want ErrInvalidOption", c.name, err)
		}
	}
	if _, err := forupdate.New(db, 0); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("no dialect: %v", err)
	}
	l, err := forupdate.New(db, sqllock.MySQL)
	if err != nil || l.MaxWaiters() != forupdate.DefaultMaxWaiters {
		t.Errorf("defaults: %v, MaxWaiters %d", err, l.MaxWaiters())
	}
	db.SetMaxOpenConns(10)
	if l, _ := forupdate.New(db, sqllock.MySQL); l.MaxWaiters() != 5 {
		t.Errorf("MaxWaiters with MaxOpenConns 10 = %d, want 5", l.MaxWaiters())
	}
	ctx := context.Background()
	if _, err := l.TryLock(ctx, "x", sqllock.WithOwner("me")); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("WithOwner: %v", err)
	}
	if _, err := l.Lock(ctx, ""); !errors.Is(err, sqllock.ErrInvalidName) {
		t.Errorf("empty name: %v", err)
	}
}
