package uniqueindex

import (
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// rowExpiry reads the expiry of name's lease row on the database clock: µs since the
// epoch, and µs left.
func rowExpiry(t testing.TB, db *sql.DB, d sqllock.Dialect, name string) (at, left int64) {
	t.Helper()
	q := `SELECT floor(extract(epoch FROM expires_at) * 1000000)::bigint,
  floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint
FROM sqllock_lease WHERE lock_key = $1`
	if d == sqllock.MySQL {
		q = `SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM sqllock_lease WHERE lock_key = ?`
	}
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name)).Scan(&at, &left); err != nil {
		t.Fatalf("lease row of %q: %v", name, err)
	}
	return at, left
}

// TestLeaseTTLOption: sqllock.WithLeaseTTL sets the lease time of one acquisition:
// through a Locker whose leases last 30 s, a lease acquired with WithLeaseTTL(2s)
// expires at most 2 s ahead on the database clock, also after its keep-alive renewed
// it (a third of 2 s later: the row's expiry moves on), and Holder reports as much;
// an acquisition without the option gets about 30 s.
func TestLeaseTTLOption(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, time.Minute)
		const ttl, short = 30 * time.Second, 2 * time.Second
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
		shortName, longName := testdb.Name(t, "short"), testdb.Name(t, "default")
		sl, err := l.Acquire(ctx, shortName, sqllock.WithLeaseTTL(short))
		if err != nil {
			t.Fatal(err)
		}
		defer sl.Release(ctx)
		ll, err := l.Acquire(ctx, longName)
		if err != nil {
			t.Fatal(err)
		}
		defer ll.Release(ctx)

		at0, left := rowExpiry(t, admin, d, shortName)
		if left <= 0 || left > short.Microseconds() {
			t.Errorf("WithLeaseTTL(%v): the lease expires %v ahead, want at most %v", short, time.Duration(left)*time.Microsecond, short)
		}
		if h, err := l.Holder(ctx, shortName); err != nil || h.Remaining > short {
			t.Errorf("WithLeaseTTL(%v): Holder = %+v, %v, want at most %v remaining", short, h, err, short)
		}
		_, left = rowExpiry(t, admin, d, longName)
		if left < (ttl-5*time.Second).Microseconds() || left > ttl.Microseconds() {
			t.Errorf("without the option: the lease expires %v ahead, want about %v", time.Duration(left)*time.Microsecond, ttl)
		}
		if h, err := l.Holder(ctx, longName); err != nil || h.Remaining < ttl-5*time.Second {
			t.Errorf("without the option: Holder = %+v, %v, want about %v remaining", h, err, ttl)
		}

		// Two renewals (the keep-alive runs every third of 2 s): the expiry moves on
		// and stays within 2 s.
		for renewal := 1; renewal <= 2; renewal++ {
			due := time.Now().Add(short) // three keep-alive intervals
			for {
				at, left := rowExpiry(t, admin, d, shortName)
				if at > at0 {
					if left > short.Microseconds() {
						t.Errorf("renewal %d: the lease expires %v ahead, want at most %v", renewal, time.Duration(left)*time.Microsecond, short)
					}
					at0 = at
					break
				}
				if left <= 0 || time.Now().After(due) {
					t.Fatalf("renewal %d: the lease's expiry did not move on in %v (%v left; lease: %v)",
						renewal, short, time.Duration(left)*time.Microsecond, sl.Err())
				}
				time.Sleep(10 * time.Millisecond) // polling the row: the database sends no signal
			}
		}
		if err := sl.Err(); err != nil {
			t.Errorf("lease with WithLeaseTTL(%v): %v", short, err)
		}
	})
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
