package optimistic_test

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
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) {
	os.Exit(testdb.MainLeakFree(m))
}

func newLocker(t testing.TB, db *sql.DB, d sqllock.Dialect, opts ...optimistic.Option) *optimistic.Locker {
	t.Helper()
	l, err := optimistic.New(db, d, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// takeOver makes the lease of name lost as a takeover would: another owner's swap
// moved the version on.
func takeOver(t testing.TB, admin *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	q := testdb.Rebind(d, "UPDATE sqllock_optimistic SET version = version + 1, owner = ? WHERE lock_key = ?")
	res, err := admin.ExecContext(testdb.Context(t, 30*time.Second), q, []byte("someone else"), namekey.Key(name))
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		t.Fatalf("took over %d rows of %q, want 1", n, name)
	}
}

// expire makes the lease of name expired on the database clock.
func expire(t testing.TB, admin *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	q := testdb.Rebind(d, "UPDATE sqllock_optimistic SET expires_at = acquired_at WHERE lock_key = ?")
	if _, err := admin.ExecContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name)); err != nil {
		t.Fatal(err)
	}
}

func TestLocktest(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, optimistic.WithTTL(ttl))
			},
			Lose: func(t testing.TB, admin *sql.DB, lease sqllock.Lease) {
				takeOver(t, admin, d, lease.Name())
			},
			PartitionBound: ttl + optimistic.DefaultPollInterval + time.Second,
			// Contended acquisitions wait in the server-side line: two statements each.
			ContendedStatements: 2.5,
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d)
			},
			LatencyHold: optimistic.DefaultTTL/3 + 2*time.Second,
		})
	})
}

// account is the caller's own versioned table of the lost-update tests.
const account = "sqllock_optimistic_testaccount"

func newAccount(t testing.TB, db *sql.DB, d sqllock.Dialect) (id string) {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	if _, err := db.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+account+
		" (id varchar(200) PRIMARY KEY, balance bigint NOT NULL, version bigint NOT NULL)"); err != nil {
		t.Logf("create: %v", err) // raced by another test binary: the INSERT tells
	}
	id = testdb.Name(t)
	if _, err := db.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+account+" (id, balance, version) VALUES (?, 0, 0)"), id); err != nil {
		t.Fatal(err)
	}
	return id
}

// increment is the read-modify-swap a user writes: read balance and version, swap
// in balance+1 with the next version.
func increment(ctx context.Context, db *sql.DB, d sqllock.Dialect, id string, versioned bool) error {
	var bal, ver int64
	if err := db.QueryRowContext(ctx, testdb.Rebind(d, "SELECT balance, version FROM "+account+" WHERE id = ?"), id).Scan(&bal, &ver); err != nil {
		return err
	}
	if !versioned { // the bug this package exists to prevent
		return optimistic.Swap(ctx, db, testdb.Rebind(d, "UPDATE "+account+" SET balance = ?, version = version + 1 WHERE id = ?"), bal+1, id)
	}
	return optimistic.Swap(ctx, db, testdb.Rebind(d, "UPDATE "+account+" SET balance = ?, version = ? WHERE id = ? AND version = ?"),
		bal+1, ver+1, id, ver)
}

// TestLostUpdates: 16 goroutines over 2 pools each make 200 read-modify-swap
// increments of one balance through Retry: the final balance is exactly 3,200. The
// same increments without the version predicate lose updates (the test can fail).
func TestLostUpdates(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, versioned := range []bool{true, false} {
			t.Run(fmt.Sprintf("versioned=%v", versioned), func(t *testing.T) {
				testdb.CheckLeaks(t)
				pools := []*sql.DB{testdb.Open(t, d), testdb.Open(t, d)}
				id := newAccount(t, pools[0], d)
				ctx := testdb.Context(t, 5*time.Minute)
				const goroutines, each = 16, 200
				var conflicts, exhausted atomic.Int64
				var wg sync.WaitGroup
				errs := make(chan error, goroutines)
				for g := 0; g < goroutines; g++ {
					db := pools[g%2]
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := 0; i < each; i++ {
							err := optimistic.Retry(ctx, func(ctx context.Context) error {
								err := increment(ctx, db, d, id, versioned)
								if errors.Is(err, optimistic.ErrConflict) {
									conflicts.Add(1)
								}
								return err
							}, optimistic.WithAttempts(1000), optimistic.WithBackoff(100*time.Microsecond, 5*time.Millisecond))
							if errors.Is(err, optimistic.ErrConflict) {
								exhausted.Add(1)
								continue
							}
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
					t.Fatal(err)
				}
				var bal int64
				if err := pools[0].QueryRowContext(ctx, testdb.Rebind(d, "SELECT balance FROM "+account+" WHERE id = ?"), id).Scan(&bal); err != nil {
					t.Fatal(err)
				}
				t.Logf("balance %d after %d increments, %d conflicts retried, %d given up", bal, goroutines*each, conflicts.Load(), exhausted.Load())
				if versioned {
					if bal != goroutines*each || exhausted.Load() != 0 {
						t.Errorf("balance %d, want %d (%d increments gave up)", bal, goroutines*each, exhausted.Load())
					}
				} else if bal >= goroutines*each {
					t.Errorf("without the version predicate no update was lost (balance %d): the test cannot tell", bal)
				}
			})
		}
	})
}

// TestTakeover: a holder whose lease expired and was taken over gets ErrLost from
// Refresh, Release and Check, and a business write guarded by Check in its
// transaction does not commit.
func TestTakeover(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		id := newAccount(t, admin, d)
		ctx := testdb.Context(t, time.Minute)
		// A long keep-alive interval, so that the test sees the takeover first.
		a := newLocker(t, testdb.Open(t, d), d, optimistic.WithTTL(time.Hour), optimistic.WithKeepalive(20*time.Minute))
		b := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		held, err := a.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		expire(t, admin, d, name)
		next, err := b.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("takeover of an expired lease: %v", err)
		}
		if next.Token() <= held.Token() {
			t.Errorf("takeover token %d, not above %d", next.Token(), held.Token())
		}
		lease := held.(*optimistic.Lease)
		tx, err := admin.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, testdb.Rebind(d, "UPDATE "+account+" SET balance = 99 WHERE id = ?"), id); err != nil {
			t.Fatal(err)
		}
		if err := lease.Check(ctx, tx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Check of a taken-over lease = %v, want ErrLost", err)
			tx.Commit()
		} else {
			tx.Rollback() // what a caller does when Check fails
		}
		var bal int64
		if err := admin.QueryRowContext(ctx, testdb.Rebind(d, "SELECT balance FROM "+account+" WHERE id = ?"), id).Scan(&bal); err != nil || bal != 0 {
			t.Errorf("the guarded write committed: balance %d, %v", bal, err)
		}
		if err := lease.Refresh(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Refresh of a taken-over lease = %v, want ErrLost", err)
		}
		if err := lease.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release of a taken-over lease = %v, want ErrLost", err)
		}
		// The loser's Release left the new holder alone.
		if err := next.(*optimistic.Lease).Refresh(ctx); err != nil {
			t.Errorf("new holder after the loser's Release: %v", err)
		}
		if err := next.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// TestTokens: tokens strictly increase across acquisitions by two Lockers, the
// takeover of an expired lease, a reaper sweep of the free row, and a restart of the
// database (when the server is a container of this test binary).
func TestTokens(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, 5*time.Minute)
		ls := []*optimistic.Locker{newLocker(t, testdb.Open(t, d), d), newLocker(t, testdb.Open(t, d), d)}
		name := testdb.Name(t)
		var last int64
		step := func(what string, l *optimistic.Locker, release bool) sqllock.Lease {
			t.Helper()
			le, err := l.Acquire(ctx, name)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			if le.Token() <= last {
				t.Errorf("%s: token %d, not above %d", what, le.Token(), last)
			}
			last = le.Token()
			if release {
				if err := le.Release(ctx); err != nil {
					t.Fatalf("%s: Release: %v", what, err)
				}
			}
			return le
		}
		for i := 0; i < 4; i++ {
			step(fmt.Sprintf("acquisition %d", i), ls[i%2], true)
		}
		held := step("before the takeover", ls[0], false)
		expire(t, admin, d, name)
		step("takeover", ls[1], true)
		held.Release(ctx) // lost
		sw, err := optimistic.NewSweeper(admin, d, 0)
		if err != nil {
			t.Fatal(err)
		}
		// Sweep with this Sweeper only (a whole reaper would sweep other tests' rows).
		deleted := 0
		for more := true; more; {
			n, m, err := sw.SweepBatch(ctx, 1000)
			if err != nil {
				t.Fatal(err)
			}
			deleted, more = deleted+n, m
		}
		var rows int
		if err := admin.QueryRowContext(ctx, testdb.Rebind(d, "SELECT count(*) FROM sqllock_optimistic WHERE lock_key = ?"), namekey.Key(name)).Scan(&rows); err != nil {
			t.Fatal(err)
		}
		if rows != 0 {
			t.Fatalf("the free row was not swept (%d rows swept)", deleted)
		}
		step("after the sweep", ls[0], true)
		step("after the sweep, other Locker", ls[1], true)
		if !testdb.Restartable(t, d) {
			return
		}
		testdb.Restart(t, d)
		fresh := newLocker(t, testdb.Open(t, d), d)
		step("after a restart", fresh, true)
	})
}

// TestBadInput: invalid names, options and Retry settings are refused before any SQL
// is sent (the pool points nowhere).
func TestBadInput(t *testing.T) {
	db, _ := sql.Open("mysql", "root@tcp(127.0.0.1:1)/none") // never connected
	defer db.Close()
	for _, opts := range [][]optimistic.Option{
		{optimistic.WithTTL(0)},
		{optimistic.WithTTL(-time.Second)},
		{optimistic.WithKeepalive(0)},
		{optimistic.WithTTL(time.Second), optimistic.WithKeepalive(600 * time.Millisecond)},
		{optimistic.WithPollInterval(0)},
		{optimistic.WithAttemptTimeout(-1)},
		{optimistic.WithLogger(nil)},
	} {
		if _, err := optimistic.New(db, sqllock.MySQL, opts...); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("New with bad options: %v, want ErrInvalidOption", err)
		}
	}
	if _, err := optimistic.New(nil, sqllock.MySQL); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("nil db: %v", err)
	}
	if _, err := optimistic.New(db, 0); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("no dialect: %v", err)
	}
	l, err := optimistic.New(db, sqllock.MySQL)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx := context.Background()
	if _, err := l.TryAcquire(ctx, ""); !errors.Is(err, sqllock.ErrInvalidName) {
		t.Errorf("empty name: %v", err)
	}
	if _, err := l.Acquire(ctx, "x", sqllock.WithLeaseTTL(-time.Second)); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("negative lease TTL: %v", err)
	}
	ran := false
	fn := func(context.Context) error { ran = true; return nil }
	for _, o := range []optimistic.RetryOption{optimistic.WithAttempts(0), optimistic.WithBackoff(0, time.Second), optimistic.WithBackoff(time.Second, time.Millisecond)} {
		if err := optimistic.Retry(ctx, fn, o); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("Retry with a bad option: %v, want ErrInvalidOption", err)
		}
	}
	if ran {
		t.Error("Retry ran fn despite a bad option")
	}
}

// TestRetry: Retry stops at the first success or non-conflict error, gives up after
// its attempts with an error matching ErrConflict, and honours ctx.
func TestRetry(t *testing.T) {
	ctx := context.Background()
	n := 0
	err := optimistic.Retry(ctx, func(context.Context) error {
		if n++; n < 3 {
			return optimistic.ErrConflict
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Errorf("Retry = %v after %d calls, want nil after 3", err, n)
	}
	n = 0
	err = optimistic.Retry(ctx, func(context.Context) error { n++; return optimistic.ErrConflict }, optimistic.WithAttempts(4))
	if !errors.Is(err, optimistic.ErrConflict) || n != 4 {
		t.Errorf("exhausted Retry = %v after %d calls", err, n)
	}
	boom := errors.New("boom")
	if err := optimistic.Retry(ctx, func(context.Context) error { return boom }); err != boom {
		t.Errorf("Retry = %v, want fn's error", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	n = 0
	err = optimistic.Retry(cctx, func(context.Context) error {
		if n++; n == 2 {
			cancel()
		}
		return optimistic.ErrConflict
	}, optimistic.WithAttempts(100))
	if !errors.Is(err, context.Canceled) || !errors.Is(err, optimistic.ErrConflict) || n != 2 {
		t.Errorf("cancelled Retry = %v after %d calls", err, n)
	}
}
