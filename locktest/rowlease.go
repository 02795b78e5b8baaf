package locktest

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// The checks below are for the row strategies (uniqueindex, optimistic, fairqueue),
// whose lease lives in a row with an expiry on the database clock.

// RowExpiry reads the expiry of le (a lease of name) in its row: µs since the Unix
// epoch, and µs left, both on the database clock.
type RowExpiry func(t testing.TB, admin *sql.DB, name string, le sqllock.Lease) (at, left int64)

// TableExpiry is the RowExpiry of a strategy whose leases are rows of table, found by
// the lock's key and, if tokenColumn is not "", by the lease's token in that column
// (fairqueue's ticket; le may then not be nil).
func TableExpiry(d sqllock.Dialect, table, tokenColumn string) RowExpiry {
	q := "SELECT floor(extract(epoch FROM expires_at) * 1000000)::bigint, " +
		"floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint FROM " + table + " WHERE lock_key = ?"
	if d == sqllock.MySQL {
		q = "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at), " +
			"TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM " + table + " WHERE lock_key = ?"
	}
	if tokenColumn != "" {
		q += " AND " + tokenColumn + " = ?"
	}
	q = testdb.Rebind(d, q)
	return func(t testing.TB, admin *sql.DB, name string, le sqllock.Lease) (at, left int64) {
		t.Helper()
		args := []any{namekey.Key(name)}
		if tokenColumn != "" {
			args = append(args, le.Token())
		}
		if err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), q, args...).Scan(&at, &left); err != nil {
			t.Fatalf("the %s row of %q: %v", table, name, err)
		}
		return at, left
	}
}

// LeaseTTLOption checks sqllock.WithLeaseTTL, which sets the lease time of one
// acquisition: through a Locker whose leases last 30 s (newLocker builds it with that
// TTL), a lease acquired with WithLeaseTTL(2s) expires at most 2 s ahead on the
// database clock, also after its keep-alive renewed it twice (the row's expiry moves
// on), and HolderInspector.Holder reports as much; an acquisition without the option
// gets about 30 s.
func LeaseTTLOption(t *testing.T, d sqllock.Dialect, newLocker func(t testing.TB, db *sql.DB, ttl time.Duration) sqllock.Locker, expiry RowExpiry) {
	testdb.CheckLeaks(t)
	admin := testdb.Open(t, d)
	ctx := testdb.Context(t, time.Minute)
	const ttl, short = 30 * time.Second, 2 * time.Second
	l := newLocker(t, testdb.Open(t, d), ttl)
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
	holder := func(name string) time.Duration {
		t.Helper()
		hi, ok := l.(sqllock.HolderInspector)
		if !ok {
			t.Fatalf("%T is not a sqllock.HolderInspector", l)
		}
		h, err := hi.Holder(ctx, name)
		if err != nil {
			t.Fatalf("Holder(%q): %v", name, err)
		}
		return h.Remaining
	}
	us := func(v int64) time.Duration { return time.Duration(v) * time.Microsecond }

	at0, left := expiry(t, admin, shortName, sl)
	if left <= 0 || us(left) > short {
		t.Errorf("WithLeaseTTL(%v): the lease expires %v ahead, want at most %v", short, us(left), short)
	}
	if r := holder(shortName); r > short {
		t.Errorf("WithLeaseTTL(%v): Holder reports %v remaining, want at most %v", short, r, short)
	}
	if _, left := expiry(t, admin, longName, ll); us(left) < ttl-5*time.Second || us(left) > ttl {
		t.Errorf("without the option: the lease expires %v ahead, want about %v", us(left), ttl)
	}
	if r := holder(longName); r < ttl-5*time.Second {
		t.Errorf("without the option: Holder reports %v remaining, want about %v", r, ttl)
	}
	// Two renewals (the keep-alive runs every third of 2 s): the expiry moves on and
	// stays within 2 s.
	for renewal := 1; renewal <= 2; renewal++ {
		due := time.Now().Add(short) // three keep-alive intervals
		for {
			at, left := expiry(t, admin, shortName, sl)
			if at > at0 {
				if us(left) > short {
					t.Errorf("renewal %d: the lease expires %v ahead, want at most %v", renewal, us(left), short)
				}
				at0 = at
				break
			}
			if left <= 0 || time.Now().After(due) {
				t.Fatalf("renewal %d: the lease's expiry did not move on in %v (%v left; lease: %v)", renewal, short, us(left), sl.Err())
			}
			time.Sleep(10 * time.Millisecond) // polling the row: the database sends no signal
		}
	}
	if err := sl.Err(); err != nil {
		t.Errorf("lease with WithLeaseTTL(%v): %v", short, err)
	}
}

// ClientClockShift checks that the client clock serves only monotonic durations:
// with one Locker's clock an hour ahead and another's an hour behind and without a
// monotonic reading (newLocker builds a Locker with TTL ttl whose clock is now),
// exclusion and renewal are unchanged: for three TTLs the holder keeps its lease and
// the other never gets the lock, which it gets, with a larger token, once released.
func ClientClockShift(t *testing.T, d sqllock.Dialect, newLocker func(t testing.TB, db *sql.DB, ttl time.Duration, now func() time.Time) sqllock.Locker) {
	testdb.CheckLeaks(t)
	const ttl = 1500 * time.Millisecond
	a := newLocker(t, testdb.Open(t, d), ttl, func() time.Time { return time.Now().Add(time.Hour) })
	b := newLocker(t, testdb.Open(t, d), ttl, func() time.Time { return time.Now().Add(-time.Hour).Round(0) }) // wall clock only
	name := testdb.Name(t)
	ctx := func() context.Context { return testdb.Context(t, 30*time.Second) }
	lease, err := a.Acquire(ctx(), name)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * ttl)
	for time.Now().Before(deadline) {
		if l, err := b.TryAcquire(ctx(), name); err == nil {
			l.Release(ctx())
			t.Fatalf("a client with a clock one hour behind acquired a held lock (the holder's lease: %v)", lease.Err())
		} else if !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Fatal(err)
		}
		select {
		case <-lease.Done():
			t.Fatalf("lease lost with a client clock one hour ahead: %v", lease.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err := lease.Release(ctx()); err != nil {
		t.Fatal(err)
	}
	l, err := b.Acquire(ctx(), name)
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= lease.Token() {
		t.Errorf("token %d after %d", l.Token(), lease.Token())
	}
	l.Release(ctx())
}
