package uniqueindex

import (
	"database/sql"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// rowExpiry reads the expiry of name's lease row on the database clock: µs since the
// epoch, and µs left.
func rowExpiry(t testing.TB, db *sql.DB, d sqllock.Dialect, name string) (at, left int64) {
	t.Helper()
	return locktest.TableExpiry(d, "sqllock_lease", "")(t, db, name, nil)
}

// TestStatementsPerAcquisition: once a Locker has used a name, an uncontended
// acquisition is one statement and its release one, on both databases, counted as
// sent (keep-alives and session setup included): with Acquire and TryAcquire alike,
// and with two Lockers (pools of their own) taking turns on the name, where on MySQL
// each takes the freed row over by its primary key (takeFreeMySQL) and never needs
// the full statement after it.
func TestStatementsPerAcquisition(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ctx := testdb.Context(t, time.Minute)
		var sent atomic.Int64
		a := newLocker(t, testdb.OpenCounting(t, d, &sent), d)
		b := newLocker(t, testdb.OpenCounting(t, d, &sent), d)
		name := testdb.Name(t)
		cycle := func(l *Locker, try bool) {
			t.Helper()
			acquire := l.Acquire
			if try {
				acquire = l.TryAcquire
			}
			le, err := acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		cycle(a, false) // first uses: the deployment checks, the statements prepared (MySQL)
		cycle(b, false)
		const n = 20
		start := sent.Load()
		for i := range n {
			cycle(a, i%2 == 1)
		}
		if got := sent.Load() - start; got != 2*n {
			t.Errorf("one Locker: %d statements for %d acquisitions and releases, want 2 each", got, n)
		}
		start = sent.Load()
		for i := range n {
			cycle([]*Locker{a, b}[i%2], i%4 >= 2)
		}
		if got := sent.Load() - start; got != 2*n {
			t.Errorf("two Lockers taking turns: %d statements for %d acquisitions and releases, want 2 each", got, n)
		}
	})
}

// TestSlowGrantRenewedBeforeReturn: a grant whose statement waited long in the server
// is renewed before Acquire returns, so a lease is never handed out nearly expired
// (README, Timing; rowlease.Fresh). The waiter's statement computes the expiry when it
// starts; here it starts once the holder's lease has expired (so it takes the row
// over) and then waits 2.5 s (more than a third of its 6 s TTL) for the row lock of
// the holder's still open Check transaction, and is granted when that commits. When
// Acquire returns, the waiter's row must have about its whole TTL left on the database
// clock, not the 3.5 s left of an expiry computed before the wait (its keep-alive,
// every 3 s, is not due yet).
func TestSlowGrantRenewedBeforeReturn(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const ttl, wait = 6 * time.Second, 2500 * time.Millisecond
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, time.Minute)
		db := testdb.Open(t, d)
		h := newLocker(t, db, d, WithTTL(time.Hour), WithKeepalive(20*time.Minute))
		w := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl), WithKeepalive(ttl/2), WithPollInterval(20*time.Millisecond))
		name := testdb.Name(t)
		hl, err := h.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		held := hl.(*Lease)
		defer held.Release(ctx)
		// The holder's lease expires 300 ms from now on the database clock (the Check
		// below must come before); nothing renews it.
		q := "UPDATE sqllock_lease SET expires_at = clock_timestamp() + interval '300 milliseconds' WHERE lock_key = $1"
		if d == sqllock.MySQL {
			q = "UPDATE sqllock_lease SET expires_at = UTC_TIMESTAMP(6) + INTERVAL 300000 MICROSECOND WHERE lock_key = ?"
		}
		if _, err := admin.ExecContext(ctx, q, namekey.Key(name)); err != nil {
			t.Fatal(err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		sid := testdb.SessionID(ctx, t, d, tx)
		if err := held.Check(ctx, tx); err != nil {
			t.Fatalf("Check of a current lease: %v", err)
		}
		for { // until the holder's lease has expired (the database sends no signal)
			if _, left := rowExpiry(t, admin, d, name); left < 0 {
				break
			}
			select {
			case <-ctx.Done():
				t.Fatal("the holder's lease never expired")
			case <-time.After(10 * time.Millisecond):
			}
		}
		type result struct {
			le  sqllock.Lease
			err error
		}
		got := make(chan result, 1)
		go func() {
			le, err := w.Acquire(ctx, name)
			got <- result{le, err}
		}()
		// Until the waiter's statement waits for the checked transaction.
		err = testdb.AwaitBlockedBy(ctx, admin, d, sid, func() (bool, error) {
			select {
			case r := <-got:
				return false, fmt.Errorf("Acquire returned while the checked transaction was open: %v", r.err)
			default:
				return true, nil
			}
		})
		if err != nil {
			t.Fatalf("the waiter's statement never waited for the checked transaction: %v", err)
		}
		blocked := time.Now()
		// The wait under test: the statement must have waited for more than a third of
		// the TTL when it is granted.
		select {
		case r := <-got:
			t.Fatalf("Acquire returned while the checked transaction was open: %v", r.err)
		case <-time.After(wait):
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		r := <-got
		if r.err != nil {
			t.Fatalf("Acquire after the checked transaction committed: %v", r.err)
		}
		defer r.le.Release(ctx)
		_, left := rowExpiry(t, admin, d, name)
		waited := time.Since(blocked)
		t.Logf("granted after waiting %v in the server; the row has %v left (TTL %v)", waited.Round(time.Millisecond),
			(time.Duration(left) * time.Microsecond).Round(time.Millisecond), ttl)
		if min := ttl - time.Second; time.Duration(left)*time.Microsecond < min {
			t.Errorf("a grant that waited %v was handed out with %v left on the database clock, want at least %v (renewed before Acquire returned)",
				waited.Round(time.Millisecond), time.Duration(left)*time.Microsecond, min)
		}
		if err := r.le.Err(); err != nil {
			t.Errorf("the slow grant's lease: %v", err)
		}
	})
}

// TestLeaseTTLOption: sqllock.WithLeaseTTL sets the lease time of one acquisition
// (locktest.LeaseTTLOption).
func TestLeaseTTLOption(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.LeaseTTLOption(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration) sqllock.Locker {
			return newLocker(t, db, d, WithTTL(ttl))
		}, locktest.TableExpiry(d, "sqllock_lease", ""))
	})
}

// TestClientClockShift: the client clock is only used for monotonic durations;
// shifted by an hour either way, exclusion and renewal are unchanged
// (locktest.ClientClockShift).
func TestClientClockShift(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.ClientClockShift(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration, now func() time.Time) sqllock.Locker {
			l := newLocker(t, db, d, WithTTL(ttl))
			l.b.Now = now
			return l
		})
	})
}
