package uniqueindex

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(m.Run())
	}
	os.Exit(testdb.MainLeakFree(m))
}

// newLocker returns a Locker on db closed at the end of the test.
func newLocker(t testing.TB, db *sql.DB, d sqllock.Dialect, opts ...Option) *Locker {
	t.Helper()
	l, err := New(db, d, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// deleteRow takes the lease row of name away from outside, as sqllock force-release
// -now does (ForceRelease).
func deleteRow(t testing.TB, admin *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ForceRelease(ctx, admin, d, name, true); err != nil {
		t.Fatal(err)
	}
}

func TestLocktest(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				// A short TTL makes the Loss and Partition cases fast.
				return newLocker(t, db, d, WithTTL(ttl))
			},
			Lose: func(t testing.TB, admin *sql.DB, lease sqllock.Lease) {
				deleteRow(t, admin, d, lease.Name())
			},
			// The row expires TTL after the last renewal; the waiter's poll lands at
			// the expiry the database reported.
			PartitionBound: ttl + DefaultPollInterval + time.Second,
			// Contended acquisitions wait in the server-side line: two statements each.
			ContendedStatements: 2.5,
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d)
			},
			// One renewal (every DefaultTTL/3) happens with the latency.
			LatencyHold: DefaultTTL/3 + 2*time.Second,
		})
	})
}
