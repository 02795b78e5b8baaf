package uniqueindex

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// TestStuckRenewalLosesAtDeadline: a renewal that cannot complete (stuck behind a
// statement of the same Locker waiting for another lock, or waiting itself for a row
// lock) does not keep the lease alive: Done closes before the lease expires by the
// database clock, and another Locker acquires only after Done closed.
func TestStuckRenewalLosesAtDeadline(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, how := range []string{"behind another acquisition", "row locked"} {
			t.Run(how, func(t *testing.T) {
				testdb.CheckLeaks(t)
				const ttl = 3 * time.Second
				ctx := testdb.Context(t, 60*time.Second)
				la := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
				lb := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl), WithPollInterval(50*time.Millisecond))
				admin := testdb.Open(t, d)
				x := testdb.Name(t, "x")
				acquiredAt := time.Now()
				leaseX, err := la.Acquire(ctx, x)
				if err != nil {
					t.Fatal(err)
				}
				defer leaseX.Release(ctx)

				tx, err := admin.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				var endTx sync.Once
				rollback := func() { endTx.Do(func() { tx.Rollback() }) }
				defer rollback()
				var other chan error
				var leaseY sqllock.Lease
				if how == "row locked" {
					// The renewal UPDATE of x waits for this row lock.
					var one int
					q := testdb.Rebind(d, "SELECT 1 FROM sqllock_lease WHERE lock_key = ? FOR UPDATE")
					if err := tx.QueryRowContext(ctx, q, namekey.Key(x)).Scan(&one); err != nil {
						t.Fatal(err)
					}
				} else {
					// A Check transaction holds y; la's Acquire(y) waits for it in the
					// database, while la's first renewal of x is due.
					lh := newLocker(t, testdb.Open(t, d), d)
					y := testdb.Name(t, "y")
					leaseY, err = lh.Acquire(ctx, y)
					if err != nil {
						t.Fatal(err)
					}
					defer leaseY.Release(ctx)
					if err := leaseY.(*Lease).Check(ctx, tx); err != nil {
						t.Fatal(err)
					}
					other = make(chan error, 1)
					go func() {
						le, err := la.Acquire(ctx, y)
						if err == nil {
							err = le.Release(ctx)
						}
						other <- err
					}()
				}

				// The other Locker tries for twice the TTL: it must never get x while x's
				// Done is open. With renewals stuck, x is lost (Done closed) before the
				// row expires; with renewals working, x stays held and is never granted.
				bctx, bcancel := context.WithTimeout(ctx, 2*ttl+time.Second)
				defer bcancel()
				got := make(chan time.Time, 1)
				go func() {
					defer close(got)
					le, err := lb.Acquire(bctx, x)
					if err != nil {
						if !errors.Is(err, sqllock.ErrNotAcquired) {
							t.Error(err)
						}
						return
					}
					at := time.Now()
					select {
					case <-leaseX.Done():
					default:
						t.Errorf("another Locker acquired %v after the holder's acquisition while its Done was open (Err %v)",
							at.Sub(acquiredAt).Round(time.Millisecond), leaseX.Err())
					}
					got <- at
					le.Release(ctx)
				}()

				if how == "row locked" {
					select {
					case <-leaseX.Done():
					case <-time.After(ttl):
						t.Errorf("Done not closed within the TTL %v while renewals were stuck", ttl)
					}
					lostAt := time.Now()
					if !errors.Is(leaseX.Err(), sqllock.ErrLost) {
						t.Errorf("Err = %v, want ErrLost", leaseX.Err())
					}
					if lostAt.Sub(acquiredAt) >= ttl {
						t.Errorf("Done closed %v after acquisition, not before the TTL %v", lostAt.Sub(acquiredAt), ttl)
					}
					rollback() // let the other Locker in (it takes the row over once expired)
					at, ok := <-got
					if !ok {
						t.Fatal("other Locker did not acquire after the holder lost the lease")
					}
					t.Logf("Done closed at %v, other Locker acquired at %v", lostAt.Sub(acquiredAt).Round(time.Millisecond),
						at.Sub(acquiredAt).Round(time.Millisecond))
					return
				}
				at, ok := <-got
				if ok {
					t.Logf("holder lost the lease, other Locker acquired at %v", at.Sub(acquiredAt).Round(time.Millisecond))
				} else if err := leaseX.Err(); err != nil {
					t.Errorf("lease lost although nothing blocked its renewals: %v", err)
				}
				rollback()
				if err := leaseY.Release(ctx); err != nil {
					t.Error(err)
				}
				if err := <-other; err != nil {
					t.Errorf("Acquire(y): %v", err)
				}
			})
		}
	})
}

// TestClientFoundRows: with clientFoundRows=true (an ON DUPLICATE KEY UPDATE that
// changes nothing then reports one row, like an insert), a held lock is still not
// granted to another owner, and takeover, re-entry and release still work.
func TestClientFoundRows(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		if d == sqllock.MySQL {
			cfg, err := mysql.ParseDSN(testdb.DSN(t, d))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ClientFoundRows = true
			if db, err = sql.Open("mysql", cfg.FormatDSN()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
		}
		ctx := testdb.Context(t, 30*time.Second)
		a := newLocker(t, db, d)
		b := newLocker(t, db, d)
		name := testdb.Name(t)
		la, err := a.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 3; i++ {
			if lb, err := b.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
				if lb != nil {
					lb.Release(ctx)
				}
				la.Release(ctx)
				t.Fatalf("TryAcquire of a held lock: %v, want ErrNotAcquired", err)
			}
		}
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		// Re-entry by the same owner key shares the token; another owner is refused.
		r1, err := a.Acquire(ctx, name, sqllock.WithOwner("job"))
		if err != nil {
			t.Fatal(err)
		}
		r2, err := a.TryAcquire(ctx, name, sqllock.WithOwner("job"))
		if err != nil {
			t.Fatal(err)
		}
		if r2.Token() != r1.Token() || r1.Token() <= la.Token() {
			t.Errorf("tokens %d, %d after %d", r1.Token(), r2.Token(), la.Token())
		}
		if _, err := a.TryAcquire(ctx, name, sqllock.WithOwner("other")); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("another owner key: %v, want ErrNotAcquired", err)
		}
		if err := r1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := b.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("TryAcquire with one hold left: %v, want ErrNotAcquired", err)
		}
		if err := r2.Release(ctx); err != nil {
			t.Fatal(err)
		}
		lb, err := b.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire after the last release: %v", err)
		}
		if lb.Token() <= r1.Token() {
			t.Errorf("token %d after %d", lb.Token(), r1.Token())
		}
		// Takeover of an expired row.
		q := testdb.Rebind(d, "UPDATE sqllock_lease SET expires_at = acquired_at WHERE lock_key = ?")
		if _, err := db.ExecContext(ctx, q, namekey.Key(name)); err != nil {
			t.Fatal(err)
		}
		lc, err := a.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("takeover of an expired row: %v", err)
		}
		if lc.Token() <= lb.Token() {
			t.Errorf("takeover token %d after %d", lc.Token(), lb.Token())
		}
		if err := lb.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release of the expired, taken over lease: %v, want ErrLost", err)
		}
		if err := lc.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// signalHandler is a slog.Handler that signals the first record whose message
// contains msg.
type signalHandler struct {
	msg  string
	once *sync.Once
	ch   chan struct{}
}

func (h signalHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h signalHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.msg) {
		h.once.Do(func() { close(h.ch) })
	}
	return nil
}
func (h signalHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h signalHandler) WithGroup(string) slog.Handler      { return h }

// TestAttemptTimeoutIsNotYet: an attempt cut by the attempt timeout while the
// caller's ctx is alive (here: waiting for the holder's Check share lock) means "not
// acquired yet": TryAcquire returns ErrNotAcquired, Acquire goes on waiting.
func TestAttemptTimeoutIsNotYet(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ctx := testdb.Context(t, 60*time.Second)
		h := newLocker(t, testdb.Open(t, d), d)
		timedOut := make(chan struct{})
		logger := slog.New(signalHandler{msg: "attempt timed out", once: new(sync.Once), ch: timedOut})
		w := newLocker(t, testdb.Open(t, d), d, WithAttemptTimeout(time.Second),
			WithPollInterval(50*time.Millisecond), WithLogger(logger))
		name := testdb.Name(t)
		held, err := h.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release(ctx)
		txdb := testdb.Open(t, d)
		tx, err := txdb.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if err := held.(*Lease).Check(ctx, tx); err != nil {
			t.Fatal(err)
		}
		if _, err := w.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("TryAcquire blocked past the attempt timeout: %v, want ErrNotAcquired", err)
		}
		got := make(chan error, 1)
		var le sqllock.Lease
		go func() {
			var err error
			le, err = w.Acquire(ctx, name)
			got <- err
		}()
		select {
		case <-timedOut: // an attempt timed out and Acquire went on waiting
		case err := <-got:
			t.Fatalf("Acquire returned while the lock was held: %v", err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Fatalf("Acquire after the holder released: %v", err)
		}
		if err := le.Release(ctx); err != nil {
			t.Error(err)
		}
	})
}

// TestRefreshBlockedPastDeadline: a Refresh that cannot complete before the lease's
// local deadline (its UPDATE waits for a Check transaction's share lock) reports
// ErrLost, not success, even though the row is still the lease's afterwards.
func TestRefreshBlockedPastDeadline(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const ttl = 2 * time.Second
		ctx := testdb.Context(t, 60*time.Second)
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
		name := testdb.Name(t)
		sl, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		lease := sl.(*Lease)
		defer lease.Release(ctx)
		txdb := testdb.Open(t, d)
		tx, err := txdb.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := lease.Check(ctx, tx); err != nil {
			t.Fatal(err)
		}
		// Unblock after the deadline in any case (without the fix Refresh waits for it).
		var endTx sync.Once
		rollback := func() { endTx.Do(func() { tx.Rollback() }) }
		defer rollback()
		timer := time.AfterFunc(ttl+2*time.Second, rollback)
		defer timer.Stop()
		start := time.Now()
		err = lease.Refresh(ctx)
		took := time.Since(start)
		rollback()
		if !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Refresh blocked past the lease's deadline: %v after %v, want ErrLost", err, took)
		}
		if took >= ttl+500*time.Millisecond {
			t.Errorf("Refresh took %v, well beyond the lease's local deadline (TTL %v)", took, ttl)
		}
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err = %v, want ErrLost", lease.Err())
		}
	})
}

// TestReentrantReleaseRace: releases and re-entries of one owner key racing on one
// lock never make a Release report a loss, and the lock is free at the end.
func TestReentrantReleaseRace(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ctx := testdb.Context(t, 60*time.Second)
		db := testdb.Open(t, d)
		name := testdb.Name(t)
		const workers, rounds = 3, 60
		var wg sync.WaitGroup
		l := newLocker(t, db, d) // reentrancy is within one Locker
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < rounds && ctx.Err() == nil; i++ {
					le, err := l.Acquire(ctx, name, sqllock.WithOwner("job"))
					if err != nil {
						t.Error(err)
						return
					}
					if err := le.Release(ctx); err != nil {
						t.Errorf("round %d: Release: %v", i, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		other := newLocker(t, db, d)
		le, err := other.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("lock not free after every hold was released: %v", err)
		}
		le.Release(ctx)
	})
}

// TestCloseDoesNotWaitForStatements: Close returns while an attempt of the Locker is
// blocked in the database (waiting for a Check transaction's share lock), and that
// attempt's Acquire still ends normally.
func TestCloseDoesNotWaitForStatements(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ctx := testdb.Context(t, 60*time.Second)
		admin := testdb.Open(t, d)
		h := newLocker(t, testdb.Open(t, d), d)
		w, err := New(testdb.Open(t, d), d, WithPollInterval(50*time.Millisecond), WithAttemptTimeout(3*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		name := testdb.Name(t)
		// Prepare w's statements (MySQL) with one acquisition first.
		le, err := w.Acquire(ctx, testdb.Name(t, "warm-up"))
		if err != nil {
			t.Fatal(err)
		}
		le.Release(ctx)
		held, err := h.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release(ctx)
		tx, err := admin.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if err := held.(*Lease).Check(ctx, tx); err != nil {
			t.Fatal(err)
		}
		actx, acancel := context.WithCancel(ctx)
		defer acancel()
		got := make(chan error, 1)
		go func() {
			_, err := w.Acquire(actx, name)
			got <- err
		}()
		// Wait until the attempt waits for the row lock in the database.
		for {
			var n int
			var err error
			if d == sqllock.Postgres {
				err = admin.QueryRowContext(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH f AS%'").Scan(&n)
			} else {
				n, err = testdb.Running(ctx, admin, d, "INSERT INTO sqllock_lease")
			}
			if err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				break
			}
			select {
			case err := <-got:
				t.Fatalf("Acquire returned while the lock was held: %v", err)
			case <-time.After(10 * time.Millisecond):
			}
		}
		closed := make(chan struct{})
		go func() {
			w.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(time.Second):
			t.Error("Close waited for a statement in flight (its attempt timeout is 3s)")
		}
		acancel()
		if err := <-got; !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("Acquire after its ctx was cancelled: %v, want ErrNotAcquired", err)
		}
		<-closed
	})
}
