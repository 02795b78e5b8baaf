package optimistic_test

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb"
)

// rowExpiry reads the expiry of name's row on the database clock: µs since the
// epoch, and µs left.
func rowExpiry(t testing.TB, db *sql.DB, d sqllock.Dialect, name string) (at, left int64) {
	t.Helper()
	return locktest.TableExpiry(d, "sqllock_optimistic", "")(t, db, name, nil)
}

// balance reads the balance of the test account id.
func balance(t testing.TB, db *sql.DB, d sqllock.Dialect, id string) int64 {
	t.Helper()
	var bal int64
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second), testdb.Rebind(d, "SELECT balance FROM "+account+" WHERE id = ?"), id).Scan(&bal); err != nil {
		t.Fatal(err)
	}
	return bal
}

// TestCheckHoldsOffTakeover: a holder's transaction that ran Check keeps the lease
// row share-locked until it ends. The lease expires on the database clock while the
// transaction is open (its keep-alive is 20 minutes away); another Locker's Acquire
// then waits for that transaction: the server shows it blocked by the holder's
// session, with the lease expired, and its Acquire has not returned. It takes the
// lock over only after the COMMIT, which commits the guarded write; the old lease is
// then lost.
func TestCheckHoldsOffTakeover(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		id := newAccount(t, admin, d)
		ctx := testdb.Context(t, time.Minute)
		db := testdb.Open(t, d)
		a := newLocker(t, db, d, optimistic.WithTTL(time.Hour), optimistic.WithKeepalive(20*time.Minute))
		b := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		sl, err := a.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		held := sl.(*optimistic.Lease)
		defer held.Release(ctx)
		// The lease expires 2 s from now on the database clock; nothing renews it.
		q := "UPDATE sqllock_optimistic SET expires_at = clock_timestamp() + interval '2 seconds' WHERE lock_key = $1"
		if d == sqllock.MySQL {
			q = "UPDATE sqllock_optimistic SET expires_at = UTC_TIMESTAMP(6) + INTERVAL 2 SECOND WHERE lock_key = ?"
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
		if _, err := tx.ExecContext(ctx, testdb.Rebind(d, "UPDATE "+account+" SET balance = 1 WHERE id = ?"), id); err != nil {
			t.Fatal(err)
		}
		if err := held.Check(ctx, tx); err != nil {
			t.Fatalf("Check of a current lease: %v", err)
		}

		type result struct {
			le  sqllock.Lease
			err error
		}
		got := make(chan result, 1)
		go func() {
			le, err := b.Acquire(ctx, name)
			got <- result{le, err}
		}()
		// Until the lease has expired and the other Acquire waits for the checked
		// transaction (polling the server: it sends no signal).
		err = testdb.AwaitBlockedBy(ctx, admin, d, sid, func() (bool, error) {
			select {
			case r := <-got:
				tok := int64(0)
				if r.err == nil {
					tok = r.le.Token()
					r.le.Release(ctx)
				}
				return false, fmt.Errorf("another Locker's Acquire returned while the checked transaction was open: token %d (the holder's %d), %v",
					tok, held.Token(), r.err)
			default:
			}
			_, left := rowExpiry(t, admin, d, name)
			return left <= 0, nil
		})
		if err != nil {
			t.Fatalf("the other Acquire never waited for the checked transaction with the lease expired: %v", err)
		}
		select {
		case r := <-got:
			t.Fatalf("another Locker's Acquire returned while it waited for the checked transaction: %v", r.err)
		default:
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var r result
		select {
		case r = <-got:
		case <-ctx.Done():
			t.Fatal("the other Locker did not take over after the checked transaction committed")
		}
		if r.err != nil {
			t.Fatalf("takeover: %v", r.err)
		}
		defer r.le.Release(ctx)
		if r.le.Token() <= held.Token() {
			t.Errorf("takeover token %d, not above %d", r.le.Token(), held.Token())
		}
		if bal := balance(t, admin, d, id); bal != 1 {
			t.Errorf("the write guarded by a passed Check did not commit: balance %d", bal)
		}
		if err := held.Refresh(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Refresh of the old lease after the takeover = %v, want ErrLost", err)
		}
	})
}

// TestStatementsPerAcquisition: a name used again by the same Locker costs one
// statement to acquire (the compare-and-swap with the version it released last) and
// one to release, on both databases, with Acquire and TryAcquire alike, counted as
// sent (keep-alives and session setup included).
func TestStatementsPerAcquisition(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ctx := testdb.Context(t, time.Minute)
		var sent atomic.Int64
		l := newLocker(t, testdb.OpenCounting(t, d, &sent), d)
		name := testdb.Name(t)
		cycle := func(try bool) {
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
		cycle(false) // first use: the deployment check, the row created
		const n = 20
		start := sent.Load()
		for i := range n {
			cycle(i%2 == 1)
		}
		if got := sent.Load() - start; got != 2*n {
			t.Errorf("a name used again: %d statements for %d acquisitions and releases, want 2 each", got, n)
		}
	})
}

// TestNotifyOnlyWhenWaited: on PostgreSQL a release notifies (a NOTIFY serialises
// the commits of the whole database) only if someone waits: an uncontended
// Acquire+Release and a refused TryAcquire send none; a release while an Acquire of
// another Locker (another process) waits, in the name's server-side line or having
// marked the row, sends one, which wakes that waiter: its polling (10 minutes) and
// the holder's lease (5 minutes) are too slow to be what woke it.
func TestNotifyOnlyWhenWaited(t *testing.T) {
	d := sqllock.Postgres
	testdb.CheckLeaks(t)
	ctx := testdb.Context(t, 2*time.Minute)
	admin := testdb.Open(t, d)
	holderL := newLocker(t, testdb.Open(t, d), d, optimistic.WithTTL(5*time.Minute), optimistic.WithPollInterval(10*time.Minute))
	waiterL := newLocker(t, testdb.Open(t, d), d, optimistic.WithPollInterval(10*time.Minute))
	quiet, waited := testdb.Name(t, "quiet"), testdb.Name(t, "waited")

	conn, err := admin.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	err = conn.Raw(func(dc any) error {
		listener := dc.(*stdlib.Conn).Conn()
		if _, err := listener.Exec(ctx, "LISTEN sqllock_optimistic"); err != nil {
			return err
		}
		defer listener.Exec(context.WithoutCancel(ctx), "UNLISTEN sqllock_optimistic")

		// Uncontended, twice (the second time the Locker swaps with the version it
		// released), and a refused TryAcquire: no NOTIFY.
		for range 2 {
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
		}

		// Contended: an Acquire of another Locker waits; the release notifies.
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
		// The signal that the waiter waits: it holds the name's line lock, or marked
		// the row (what the release looks at).
		waiting := `SELECT waiters OR NOT pg_try_advisory_xact_lock_shared(` + wait.PgLineKey("optimistic", "$1") + `)
FROM sqllock_optimistic WHERE lock_key = $1`
		for w := false; !w; {
			if err := admin.QueryRowContext(ctx, waiting, namekey.Key(waited)).Scan(&w); err != nil {
				return err
			}
			if !w {
				time.Sleep(5 * time.Millisecond) // polling the server's view: there is no signal
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
			return errors.New("the waiter was not woken by the release (its poll interval is 10 minutes, the holder's lease 5)")
		}
		t.Logf("the waiter got the lock %v after the release", time.Since(released))

		// Notifications come in commit order: the quiet releases, had they notified,
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

// TestLeaseTTLOption: sqllock.WithLeaseTTL sets the lease time of one acquisition
// (locktest.LeaseTTLOption).
func TestLeaseTTLOption(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.LeaseTTLOption(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration) sqllock.Locker {
			return newLocker(t, db, d, optimistic.WithTTL(ttl))
		}, locktest.TableExpiry(d, "sqllock_optimistic", ""))
	})
}

// TestClientClockShift: the client clock is only used for monotonic durations;
// shifted by an hour either way, exclusion and renewal are unchanged
// (locktest.ClientClockShift).
func TestClientClockShift(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.ClientClockShift(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration, now func() time.Time) sqllock.Locker {
			l := newLocker(t, db, d, optimistic.WithTTL(ttl))
			optimistic.SetNow(l, now)
			return l
		})
	})
}
