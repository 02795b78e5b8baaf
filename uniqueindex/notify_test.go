package uniqueindex_test

import (
	"context"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// TestNotifyOnlyWhenWaited: on PostgreSQL a release sends its NOTIFY (which
// serialises the commits of the whole database) only if an Acquire waits for the lock:
// an uncontended Acquire+Release and a failed TryAcquire send none, and a release
// with a waiter in another process wakes it, with polling too slow to be what woke it.
func TestNotifyOnlyWhenWaited(t *testing.T) {
	d := sqllock.Postgres
	ctx := testdb.Context(t, 2*time.Minute)
	holderL, waiterL := slowPollLocker(t), slowPollLocker(t)
	admin := testdb.Open(t, d)
	quiet, waited := testdb.Name(t, "quiet"), testdb.Name(t, "waited")

	conn, err := admin.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	err = conn.Raw(func(dc any) error {
		listener := dc.(*stdlib.Conn).Conn()
		if _, err := listener.Exec(ctx, "LISTEN sqllock_lease"); err != nil {
			return err
		}
		defer listener.Exec(context.WithoutCancel(ctx), "UNLISTEN sqllock_lease")

		// Uncontended: no NOTIFY.
		le, err := holderL.Acquire(ctx, quiet)
		if err != nil {
			return err
		}
		if _, err := waiterL.TryAcquire(ctx, quiet); !errors.Is(err, sqllock.ErrNotAcquired) {
			return errors.New("TryAcquire of a held lock did not fail")
		}
		if err := le.Release(ctx); err != nil {
			return err
		}

		// Contended: a waiter in another Locker marks the row; the release notifies.
		holder, err := holderL.Acquire(ctx, waited)
		if err != nil {
			return err
		}
		got := make(chan error, 1)
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() {
			le, err := waiterL.Acquire(wctx, waited)
			if err == nil {
				err = le.Release(ctx)
			}
			got <- err
		}()
		for marked := false; !marked; {
			// The signal that the waiter waits: its failed attempt marked the row.
			if err := admin.QueryRowContext(ctx, "SELECT waiters FROM sqllock_lease WHERE lock_key = $1", namekey.Key(waited)).Scan(&marked); err != nil {
				return err
			}
		}
		released := time.Now()
		if err := holder.Release(ctx); err != nil {
			return err
		}
		select {
		case err := <-got:
			if err != nil {
				return err
			}
		case <-time.After(30 * time.Second):
			return errors.New("the waiter was not woken by the release (its poll interval is 10 minutes)")
		}
		t.Logf("the waiter got the lock %v after the release", time.Since(released))

		// Notifications come in commit order: the quiet release, had it notified,
		// would come before the waited one's.
		quietKey, waitedKey := hex.EncodeToString(namekey.Key(quiet)), hex.EncodeToString(namekey.Key(waited))
		for {
			n, err := listener.WaitForNotification(ctx)
			if err != nil {
				return err
			}
			switch n.Payload {
			case quietKey:
				return errors.New("a release nobody waited for sent a NOTIFY")
			case waitedKey:
				return nil
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestWaiterWokenWhileHolderCycles: a holder that releases and at once acquires again
// (a hot loop in another process) must not starve a waiter whose polling is too slow
// to matter (10 minutes): every release must wake it, which needs the waiter's mark
// on the holder's current row, not on a row of the waiter's snapshot that the holder
// already replaced.
func TestWaiterWokenWhileHolderCycles(t *testing.T) {
	ctx := testdb.Context(t, 2*time.Minute)
	hot, waiter := slowPollLocker(t), slowPollLocker(t)
	name := testdb.Name(t)
	stop := make(chan struct{})
	cycles := make(chan int, 1)
	go func() {
		n := 0
		defer func() { cycles <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			le, err := hot.Acquire(ctx, name)
			if err != nil {
				t.Error(err)
				return
			}
			for t0 := time.Now(); time.Since(t0) < 200*time.Microsecond; { // the critical section
			}
			if err := le.Release(ctx); err != nil {
				t.Error(err)
				return
			}
			n++
		}
	}()
	start := time.Now()
	const rounds = 20
	for i := range rounds {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		le, err := waiter.Acquire(wctx, name)
		cancel()
		if err != nil {
			close(stop)
			t.Fatalf("round %d: the waiter did not get the lock in 10 s while the holder cycled (%d cycles): %v", i, <-cycles, err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	t.Logf("the waiter got the lock %d times in %v while the holder cycled %d times", rounds, time.Since(start), <-cycles)
}

// slowPollLocker is a PostgreSQL Locker (a pool of its own, as another process has)
// whose waiters poll every 10 minutes: only a NOTIFY wakes them in a test's time.
func slowPollLocker(t *testing.T) *uniqueindex.Locker {
	d := sqllock.Postgres
	l, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithPollInterval(10*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}
