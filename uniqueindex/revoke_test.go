package uniqueindex

import (
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// TestForceRelease: what ForceRelease promises besides the CLI's test (cmd/sqllock):
// a revoked lock is not granted to anyone before its lease expires; a name without a
// live lease (never held, or its holder dead and its row expired) is ErrNotHeld on
// both databases, with and without now; an unknown dialect is ErrInvalidOption.
func TestForceRelease(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		admin := testdb.Open(t, d)
		holder := newLocker(t, testdb.Open(t, d), d)
		other := newLocker(t, testdb.Open(t, d), d)

		if err := ForceRelease(ctx, admin, 0, "x", false); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("unknown dialect: %v, want ErrInvalidOption", err)
		}
		free := testdb.Name(t) + "/free"
		for _, now := range []bool{false, true} {
			if err := ForceRelease(ctx, admin, d, free, now); !errors.Is(err, sqllock.ErrNotHeld) {
				t.Errorf("never held, now=%v: %v, want ErrNotHeld", now, err)
			}
		}

		revoked := testdb.Name(t) + "/revoked"
		le, err := holder.Acquire(ctx, revoked)
		if err != nil {
			t.Fatal(err)
		}
		defer le.Release(ctx)
		if err := ForceRelease(ctx, admin, d, revoked, false); err != nil {
			t.Fatal(err)
		}
		if got, err := other.TryAcquire(ctx, revoked); err == nil {
			got.Release(ctx)
			t.Error("a revoked lease's lock was granted before the lease expired")
		} else if !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Fatal(err)
		}

		expired := testdb.Name(t) + "/expired"
		dead, err := holder.Acquire(ctx, expired) // its keep-alive is 10 s away
		if err != nil {
			t.Fatal(err)
		}
		defer dead.Release(ctx)
		q := "UPDATE sqllock_lease SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE lock_key = ?"
		if d == sqllock.Postgres {
			q = "UPDATE sqllock_lease SET expires_at = clock_timestamp() - interval '1 second' WHERE lock_key = $1"
		}
		if _, err := admin.ExecContext(ctx, q, namekey.Key(expired)); err != nil {
			t.Fatal(err)
		}
		for _, now := range []bool{false, true} {
			if err := ForceRelease(ctx, admin, d, expired, now); !errors.Is(err, sqllock.ErrNotHeld) {
				t.Errorf("expired, now=%v: %v, want ErrNotHeld", now, err)
			}
		}
	})
}
