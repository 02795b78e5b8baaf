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
	newLocker := func() *uniqueindex.Locker {
		l, err := uniqueindex.New(testdb.Open(t, d), d, uniqueindex.WithPollInterval(10*time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	holderL, waiterL := newLocker(), newLocker()
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
