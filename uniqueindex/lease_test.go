package uniqueindex

import (
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

func TestNewValidates(t *testing.T) {
	db := testdb.Open(t, sqllock.Postgres)
	for _, opts := range [][]Option{
		{WithTTL(time.Second), WithKeepalive(600 * time.Millisecond)},
		{WithTTL(-time.Second)},
		{WithKeepalive(-time.Second)},
		{WithPollInterval(0)},
		{WithAttemptTimeout(-1)},
	} {
		if _, err := New(db, sqllock.Postgres, opts...); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("New with bad options: %v, want ErrInvalidOption", err)
		}
	}
	if _, err := New(db, 0); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("New with no dialect: %v", err)
	}
}

// TestLossWithinRenewInterval: a lease whose row is deleted, or taken over (expired and
// re-acquired by another owner), closes Done within one renewal interval, and its
// Release returns ErrLost.
func TestLossWithinRenewInterval(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		const ttl, renew = 3 * time.Second, time.Second
		a := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl), WithKeepalive(renew))
		b := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))

		for _, how := range []string{"deleted", "taken over"} {
			t.Run(how, func(t *testing.T) {
				name := testdb.Name(t)
				lease, err := a.Acquire(testdb.Context(t, 30*time.Second), name)
				if err != nil {
					t.Fatal(err)
				}
				start := time.Now()
				var next sqllock.Lease
				if how == "deleted" {
					deleteRow(t, admin, d, name)
				} else {
					// Expire it on the database clock, then another owner takes it over.
					q := testdb.Rebind(d, "UPDATE sqllock_lease SET expires_at = acquired_at WHERE lock_key = ?")
					if _, err := admin.ExecContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name)); err != nil {
						t.Fatal(err)
					}
					next, err = b.TryAcquire(testdb.Context(t, 30*time.Second), name)
					if err != nil {
						t.Fatalf("takeover of an expired row: %v", err)
					}
					if next.Token() <= lease.Token() {
						t.Errorf("takeover token %d <= %d", next.Token(), lease.Token())
					}
				}
				select {
				case <-lease.Done():
				case <-time.After(renew + 500*time.Millisecond):
					t.Fatalf("Done not closed %v after the row was %s", renew+500*time.Millisecond, how)
				}
				t.Logf("%s: Done closed after %v (renewal interval %v)", how, time.Since(start).Round(time.Millisecond), renew)
				if !errors.Is(lease.Err(), sqllock.ErrLost) {
					t.Errorf("Err = %v, want ErrLost", lease.Err())
				}
				if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
					t.Errorf("Release = %v, want ErrLost", err)
				}
				if next != nil {
					// The lost lease's Release did not delete the new holder's row.
					if err := next.(*Lease).Refresh(testdb.Context(t, 30*time.Second)); err != nil {
						t.Errorf("new holder after the loser's Release: %v", err)
					}
					if err := next.Release(testdb.Context(t, 30*time.Second)); err != nil {
						t.Error(err)
					}
				}
			})
		}
	})
}

// TestLocalDeadline: when renewals cannot reach the database, the lease is given up
// on the client before the database lets another client take it over.
func TestLocalDeadline(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		const ttl = 2 * time.Second
		a := newLocker(t, db, d, WithTTL(ttl), WithAttemptTimeout(200*time.Millisecond))
		b := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl), WithPollInterval(50*time.Millisecond))
		name := testdb.Name(t)
		lease, err := a.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		// Cut the holder off the database: its pool can no longer connect.
		db.SetMaxOpenConns(1)
		conn, err := db.Conn(testdb.Context(t, 30*time.Second)) // the only connection, pinned
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan time.Time, 1)
		go func() {
			l, err := b.Acquire(testdb.Context(t, 30*time.Second), name)
			if err != nil {
				t.Error(err)
				close(got)
				return
			}
			got <- time.Now()
			l.Release(testdb.Context(t, 30*time.Second))
		}()
		select {
		case <-lease.Done():
		case <-time.After(ttl):
			t.Fatal("lease not given up within its TTL while renewals were impossible")
		}
		lostAt := time.Now()
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err = %v", lease.Err())
		}
		at, ok := <-got
		if ok && at.Before(lostAt) {
			t.Errorf("another client acquired at %v, before the holder gave up at %v", at, lostAt)
		}
		t.Logf("holder gave up %v before the other client acquired", at.Sub(lostAt).Round(time.Millisecond))
		conn.Close()
		if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release = %v, want ErrLost", err)
		}
	})
}

// TestReentrant: WithOwner re-enters, counts holds, and the lock is free only after
// the last release.
func TestReentrant(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		a := newLocker(t, testdb.Open(t, d), d)
		b := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		l1, err := a.Acquire(ctx, name, sqllock.WithOwner("job-1"))
		if err != nil {
			t.Fatal(err)
		}
		l2, err := a.TryAcquire(ctx, name, sqllock.WithOwner("job-1"))
		if err != nil {
			t.Fatalf("re-entry by the same owner key through the same Locker: %v", err)
		}
		if l2.Token() != l1.Token() {
			t.Errorf("re-entry token %d, want %d", l2.Token(), l1.Token())
		}
		if _, err := a.TryAcquire(ctx, name, sqllock.WithOwner("job-2")); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("other owner: %v, want ErrNotAcquired", err)
		}
		// The key is scoped to its Locker: the same key through another Locker (another
		// replica) is another owner.
		if _, err := b.TryAcquire(ctx, name, sqllock.WithOwner("job-1")); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("same owner key through another Locker: %v, want ErrNotAcquired", err)
		}
		if _, err := a.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("no owner key: %v, want ErrNotAcquired", err)
		}
		if err := l1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := b.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("after one of two releases: %v, want ErrNotAcquired", err)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
		l3, err := b.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("after both releases: %v", err)
		}
		if l3.Token() <= l1.Token() {
			t.Errorf("token %d after %d", l3.Token(), l1.Token())
		}
		l3.Release(ctx)
	})
}

// TestTokensAcrossRestart: tokens keep increasing across a restart of the database
// container. Against servers given by DSN (which cannot be restarted) it logs and
// returns; in CI it fails if it cannot restart.
func TestTokensAcrossRestart(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		if !testdb.Restartable(t, d) {
			return
		}
		name := testdb.Name(t)
		var last int64
		for i := 0; i < 3; i++ {
			l := newLocker(t, testdb.Open(t, d), d)
			lease, err := l.Acquire(testdb.Context(t, 2*time.Minute), name)
			if err != nil {
				t.Fatalf("round %d: %v", i, err)
			}
			if lease.Token() <= last {
				t.Errorf("round %d: token %d after %d", i, lease.Token(), last)
			}
			last = lease.Token()
			if err := lease.Release(testdb.Context(t, time.Minute)); err != nil {
				t.Fatal(err)
			}
			if i < 2 {
				testdb.Restart(t, d)
			}
		}
		t.Logf("tokens increased across 2 restarts, last %d", last)
	})
}

// TestCheck: the fencing check passes in a transaction while the lease is current,
// holds off a takeover until that transaction ends, and fails once the lease is lost.
func TestCheck(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		admin := testdb.Open(t, d)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		sl, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		lease := sl.(*Lease)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := lease.Check(ctx, tx); err != nil {
			t.Fatalf("Check of a current lease: %v", err)
		}
		// While tx holds the share lock, deleting the row from outside waits.
		deleted := make(chan error, 1)
		go func() {
			_, err := admin.ExecContext(ctx, testdb.Rebind(d, "DELETE FROM sqllock_lease WHERE lock_key = ?"), namekey.Key(name))
			deleted <- err
		}()
		select {
		case err := <-deleted:
			t.Fatalf("row deleted while a checked transaction was open: %v", err)
		case <-time.After(300 * time.Millisecond): // the DELETE is blocked, as it should be
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := <-deleted; err != nil {
			t.Fatal(err)
		}
		tx, err = db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if err := lease.Check(ctx, tx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Check after the row was deleted: %v, want ErrLost", err)
		}
		tx.Rollback()
		if err := lease.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release: %v, want ErrLost", err)
		}
	})
}

// TestCloseKeepsLeases: Close stops the Locker's listener and prepared statements;
// leases acquired before keep working until released.
func TestCloseKeepsLeases(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		l := newLocker(t, testdb.Open(t, d), d)
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Acquire(ctx, testdb.Name(t), sqllock.WithLeaseTTL(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		if err := lease.(*Lease).Refresh(ctx); err != nil {
			t.Fatalf("Refresh after Close: %v", err)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatalf("Release after Close: %v", err)
		}
		if err := lease.(*Lease).Refresh(ctx); !errors.Is(err, sqllock.ErrNotHeld) {
			t.Errorf("Refresh after Release: %v, want ErrNotHeld", err)
		}
	})
}
