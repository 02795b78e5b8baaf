package advisory_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

func newLocker(t testing.TB, db *sql.DB, d sqllock.Dialect, opts ...advisory.Option) *advisory.Locker {
	t.Helper()
	l, err := advisory.New(db, d, opts...)
	if err != nil {
		t.Fatalf("advisory.New: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// kill ends the session holding lease from admin, as a failure would.
func kill(t testing.TB, admin *sql.DB, d sqllock.Dialect, lease sqllock.Lease) {
	t.Helper()
	testdb.Kill(testdb.Context(t, 30*time.Second), t, admin, d, lease.(*advisory.Lease).SessionID())
}

func TestLocktest(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, advisory.WithTTL(ttl), advisory.WithKeepalive(500*time.Millisecond))
			},
			Lose: func(t testing.TB, admin *sql.DB, lease sqllock.Lease) { kill(t, admin, d, lease) },
			// The server ends the partitioned session TTL after its last keep-alive;
			// the waiter's GET_LOCK / pg_advisory_lock is granted at once then.
			PartitionBound: ttl + 2*time.Second, // the server's timer and a loaded CI machine: up to 2 s late
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d)
			},
			// Finding 15: after an operator's kill the lease reports itself held for
			// at most the default keep-alive interval (2s, was 5s) plus the check.
			KillWindow: advisory.DefaultKeepalive + 1500*time.Millisecond,
		})
	})
}

// TestSessionKilled: Done closes within one keepalive interval plus one second of the
// kill, another client acquires, and the old lease's Release returns ErrLost.
func TestSessionKilled(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const keepalive = time.Second
		holder := newLocker(t, testdb.Open(t, d), d, advisory.WithKeepalive(keepalive))
		other := newLocker(t, testdb.Open(t, d), d)
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		lease, err := holder.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		kill(t, admin, d, lease)
		killed := time.Now()
		select {
		case <-lease.Done():
			t.Logf("Done closed %v after the kill", time.Since(killed).Round(time.Millisecond))
		case <-time.After(keepalive + time.Second):
			t.Fatalf("Done not closed %v after the session was killed", keepalive+time.Second)
		}
		if !errors.Is(lease.Err(), sqllock.ErrLost) {
			t.Errorf("Err() = %v, want ErrLost", lease.Err())
		}
		next, err := other.TryAcquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatalf("TryAcquire by another client after the kill: %v", err)
		}
		if next.Token() <= lease.Token() {
			t.Errorf("token %d after the kill, not above %d", next.Token(), lease.Token())
		}
		if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release of the lost lease = %v, want ErrLost", err)
		}
		if err := next.Release(testdb.Context(t, 30*time.Second)); err != nil {
			t.Errorf("Release: %v", err)
		}
	})
}

// serverHolds reports how many sessions hold or wait for the lock of name.
func serverHolds(t testing.TB, admin *sql.DB, d sqllock.Dialect, l *advisory.Locker, name string) int {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	var n int
	if d == sqllock.Postgres {
		k1, k2 := l.PostgresKeys(name)
		err := admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 2`,
			int64(uint32(k1)), int64(uint32(k2))).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	lock, err := l.MySQLLockName(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	var holder sql.NullInt64
	if err := admin.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", lock).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	if holder.Valid {
		n++
	}
	waiting, err := testdb.Running(ctx, admin, d, "GET_LOCK('"+lock+"'")
	if err != nil {
		t.Fatal(err)
	}
	return n + waiting
}

// waitNoHolds waits until the server has no session holding or waiting for name: a
// discarded session is cleaned up by the server asynchronously.
func waitNoHolds(t testing.TB, admin *sql.DB, d sqllock.Dialect, l *advisory.Locker, name string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := serverHolds(t, admin, d, l, name)
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions still hold or wait for %q on the server", n, name)
		}
		time.Sleep(50 * time.Millisecond) // polling the server: there is no signal to wait on
	}
}

// TestCancellationStorm: 1,000 Acquire calls block on a held lock (most of them on a
// pool slot: the pool has 50 connections); half are cancelled at random moments, some
// after the holder released. Exclusion holds, every call returns a proper result, and
// afterwards no lock, waiting session or pooled connection is left behind.
func TestCancellationStorm(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const (
			callers = 1000
			release = 750 * time.Millisecond
			spread  = 1500 * time.Millisecond
		)
		db := testdb.Open(t, d)
		db.SetMaxOpenConns(50)
		l := newLocker(t, db, d, advisory.WithKeepalive(time.Second))
		holderL := newLocker(t, testdb.Open(t, d), d)
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		holder, err := holderL.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}

		var (
			wg                            sync.WaitGroup
			inside, overlaps              atomic.Int32
			acquired, cancelled, timedOut atomic.Int32
			errMu                         sync.Mutex
			errs                          []error
			lastTok                       atomic.Int64
			tokenFault                    atomic.Bool
		)
		start := time.Now()
		for i := 0; i < callers; i++ {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			if i%2 == 0 {
				time.AfterFunc(rand.N(spread), cancel)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer cancel()
				lease, err := l.Acquire(ctx, name)
				switch {
				case err == nil:
					if inside.Add(1) > 1 {
						overlaps.Add(1)
					}
					if tok := lease.Token(); tok <= lastTok.Load() {
						tokenFault.Store(true)
					} else {
						lastTok.Store(tok)
					}
					inside.Add(-1)
					acquired.Add(1)
					if err := lease.Release(context.Background()); err != nil {
						errMu.Lock()
						errs = append(errs, fmt.Errorf("Release: %w", err))
						errMu.Unlock()
					}
				case errors.Is(err, sqllock.ErrNotAcquired) && errors.Is(err, context.Canceled):
					cancelled.Add(1)
				case errors.Is(err, sqllock.ErrNotAcquired) && errors.Is(err, context.DeadlineExceeded):
					timedOut.Add(1)
				default:
					errMu.Lock()
					errs = append(errs, fmt.Errorf("Acquire: %w (lease %v)", err, lease))
					errMu.Unlock()
				}
			}()
		}
		time.Sleep(time.Until(start.Add(release))) // the holder holds for a while, on purpose
		// Some callers really wait on the server (the rest wait for a pool slot): wait
		// for them (a slow machine starts 1,000 goroutines slowly).
		waiting := serverHolds(t, admin, d, l, name) - 1
		for deadline := time.Now().Add(15 * time.Second); waiting < 10 && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond) // polling the server: it sends no signal
			waiting = serverHolds(t, admin, d, l, name) - 1
		}
		t.Logf("%d sessions waiting on the server when the holder releases", waiting)
		if waiting < 10 {
			t.Errorf("only %d sessions waiting on the server: the storm did not reach the database", waiting)
		}
		if err := holder.Release(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		t.Logf("%d acquired, %d cancelled, %d timed out in %v", acquired.Load(), cancelled.Load(), timedOut.Load(),
			time.Since(start).Round(time.Millisecond))
		for i, err := range errs {
			if i == 10 {
				break
			}
			t.Error(err)
		}
		if n := acquired.Load() + cancelled.Load() + timedOut.Load(); n != callers || len(errs) > 0 {
			t.Errorf("%d of %d calls returned a proper result; %d errors", n, callers, len(errs))
		}
		if cancelled.Load() == 0 || acquired.Load() < callers/2 {
			t.Errorf("the storm did not happen as planned: %d cancelled, %d acquired", cancelled.Load(), acquired.Load())
		}
		if o := overlaps.Load(); o != 0 {
			t.Errorf("mutual exclusion violated %d times", o)
		}
		if tokenFault.Load() {
			t.Error("tokens did not increase in grant order")
		}
		l.Close() // returns the sessions it keeps for reuse (MySQL)
		// database/sql counts a connection it opens in the background (to replace a
		// discarded one for a request that was cancelled meanwhile) as in use until
		// it is open: poll, briefly (it sends no signal).
		inUse := db.Stats().InUse
		for deadline := time.Now().Add(5 * time.Second); inUse != 0 && time.Now().Before(deadline); inUse = db.Stats().InUse {
			time.Sleep(10 * time.Millisecond)
		}
		if inUse != 0 {
			t.Errorf("%d connections still in use 5 s after Close", inUse)
		}
		cleaned := time.Now()
		waitNoHolds(t, admin, d, l, name)
		t.Logf("server clean %v after the last call returned", time.Since(cleaned).Round(time.Millisecond))
		// The lock is free for anyone.
		after, err := holderL.TryAcquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatalf("TryAcquire after the storm: %v", err)
		}
		if err := after.Release(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
	})
}

// TestHashtextCollision: 'lock-8327' and 'lock-68168' collide under hashtext on
// PostgreSQL 15; they must be two independent locks.
func TestHashtextCollision(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		if d == sqllock.Postgres {
			var same bool
			if err := db.QueryRowContext(testdb.Context(t, 30*time.Second),
				"SELECT hashtext('lock-8327') = hashtext('lock-68168')").Scan(&same); err != nil {
				t.Fatal(err)
			}
			if !same {
				t.Fatal("precondition: hashtext('lock-8327') and hashtext('lock-68168') no longer collide")
			}
		}
		// A namespace of this test, so that the fixed names do not meet other runs.
		ns := advisory.WithNamespace(testdb.Name(t))
		a := newLocker(t, db, d, ns, advisory.WithoutToken())
		b := newLocker(t, testdb.Open(t, d), d, ns, advisory.WithoutToken())
		ctx := testdb.Context(t, 30*time.Second)
		la, err := a.TryAcquire(ctx, "lock-8327")
		if err != nil {
			t.Fatal(err)
		}
		lb, err := b.TryAcquire(ctx, "lock-68168")
		if err != nil {
			t.Fatalf("'lock-68168' while 'lock-8327' is held: %v", err)
		}
		if _, err := b.TryAcquire(ctx, "lock-8327"); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("second holder of 'lock-8327': %v, want ErrNotAcquired", err)
		}
		for _, le := range []sqllock.Lease{la, lb} {
			if err := le.Release(ctx); err != nil {
				t.Error(err)
			}
		}
	})
}

// TestShared: on PostgreSQL many shared holders at once, writers excluded while they
// hold, readers excluded while a writer holds. MySQL refuses the shared mode.
func TestShared(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		w := newLocker(t, db, d)
		r, err := w.Shared()
		if d == sqllock.MySQL {
			if !errors.Is(err, sqllock.ErrInvalidOption) || r != nil {
				t.Fatalf("Shared() on MySQL = %v, %v; want ErrInvalidOption", r, err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		name := testdb.Name(t)
		ctx := testdb.Context(t, 60*time.Second)
		const readers = 20
		leases := make([]sqllock.Lease, readers)
		var wg sync.WaitGroup
		errs := make([]error, readers)
		for i := range leases {
			wg.Add(1)
			go func() {
				defer wg.Done()
				leases[i], errs[i] = r.TryAcquire(ctx, name)
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatalf("shared TryAcquire while other readers hold: %v", err)
			}
		}
		if _, err := w.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Fatalf("exclusive TryAcquire while %d readers hold: %v, want ErrNotAcquired", readers, err)
		}
		// A blocked writer gets the lock when the last reader goes.
		got := make(chan sqllock.Lease, 1)
		go func() {
			le, err := w.Acquire(ctx, name)
			if err != nil {
				t.Error(err)
			}
			got <- le
		}()
		for _, le := range leases[1:] {
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-got:
			t.Fatal("writer acquired while a reader still holds")
		case <-time.After(200 * time.Millisecond): // absence of an event: nothing to wait on
		}
		if err := leases[0].Release(ctx); err != nil {
			t.Fatal(err)
		}
		wlease := <-got
		if wlease == nil {
			t.FailNow()
		}
		if _, err := r.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("shared TryAcquire while a writer holds: %v, want ErrNotAcquired", err)
		}
		if err := wlease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// TestReentrant: without an owner a second acquisition from the same Locker is
// refused; with sqllock.WithOwner the owner re-enters, shares the session and token,
// and the lock is free only after the last Release.
func TestReentrant(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		l := newLocker(t, db, d)
		other := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		own := sqllock.WithOwner("job-42")

		first, err := l.Acquire(ctx, name, own)
		if err != nil {
			t.Fatal(err)
		}
		second, err := l.TryAcquire(ctx, name, own)
		if err != nil {
			t.Fatalf("re-entry by the same owner: %v", err)
		}
		third, err := l.Acquire(ctx, name, own)
		if err != nil {
			t.Fatalf("second re-entry by the same owner: %v", err)
		}
		if first.Token() != second.Token() || second.(*advisory.Lease).SessionID() != first.(*advisory.Lease).SessionID() {
			t.Error("re-entrant holds do not share session and token")
		}
		if _, err := l.TryAcquire(ctx, name, sqllock.WithOwner("someone-else")); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("another owner on the same Locker: %v, want ErrNotAcquired", err)
		}
		if _, err := l.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("no owner on the same Locker: %v, want ErrNotAcquired", err)
		}
		for i, le := range []sqllock.Lease{third, first} {
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := other.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Fatalf("after %d of 3 releases the lock is free: %v", i+1, err)
			}
			if second.Err() != nil {
				t.Fatalf("a remaining hold ended: %v", second.Err())
			}
		}
		if err := second.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := first.Release(ctx); err != nil {
			t.Errorf("second Release of one hold: %v, want nil", err)
		}
		after, err := other.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("after the last release: %v", err)
		}
		if after.Token() <= first.Token() {
			t.Errorf("token %d not above %d", after.Token(), first.Token())
		}
		if err := after.Release(ctx); err != nil {
			t.Fatal(err)
		}
		l.Close() // returns the sessions it keeps for reuse (MySQL)
		if n := db.Stats().InUse; n != 0 {
			t.Errorf("%d connections in use", n)
		}
	})
}

// TestTxAndKeys: transaction-scoped locks and raw bigint keys on PostgreSQL; MySQL
// refuses both with ErrInvalidOption.
func TestTxAndKeys(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		db := testdb.Open(t, d)
		l := newLocker(t, db, d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		tok, err := l.AcquireTx(ctx, tx, name)
		if d == sqllock.MySQL {
			if !errors.Is(err, sqllock.ErrInvalidOption) {
				t.Errorf("AcquireTx on MySQL: %v, want ErrInvalidOption", err)
			}
			if _, err := l.TryAcquireKey(ctx, 42); !errors.Is(err, sqllock.ErrInvalidOption) {
				t.Errorf("TryAcquireKey on MySQL: %v, want ErrInvalidOption", err)
			}
			return
		}
		if err != nil || tok <= 0 {
			t.Fatalf("AcquireTx = %d, %v", tok, err)
		}
		if _, err := l.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("TryAcquire while a transaction holds: %v, want ErrNotAcquired", err)
		}
		tx2, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := l.TryAcquireTx(ctx, tx2, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Errorf("TryAcquireTx while another transaction holds: %v, want ErrNotAcquired", err)
		}
		tx2.Rollback()
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		le, err := l.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire after COMMIT: %v", err)
		}
		if le.Token() <= tok {
			t.Errorf("token %d not above the transaction's %d", le.Token(), tok)
		}
		le.Release(ctx)

		// Raw bigint keys are the keys of pg_advisory_lock(bigint).
		key := rand.Int64()
		kl, err := l.TryAcquireKey(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		var ok bool
		if err := db.QueryRowContext(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&ok); err != nil || ok {
			t.Errorf("raw pg_try_advisory_lock(%d) while AcquireKey holds it = %v, %v; want false", key, ok, err)
		}
		if err := kl.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

func TestNewOptions(t *testing.T) {
	db, _ := sql.Open("pgx", "postgres://invalid")
	defer db.Close()
	for _, c := range []struct {
		name string
		d    sqllock.Dialect
		opts []advisory.Option
	}{
		{"bad dialect", 0, nil},
		{"keepalive", sqllock.Postgres, []advisory.Option{advisory.WithKeepalive(0)}},
		{"keepalive above TTL/2", sqllock.Postgres, []advisory.Option{advisory.WithTTL(time.Second), advisory.WithKeepalive(600 * time.Millisecond)}},
		{"TTL", sqllock.Postgres, []advisory.Option{advisory.WithTTL(0)}},
		{"TTL under 1s on MySQL", sqllock.MySQL, []advisory.Option{advisory.WithTTL(500 * time.Millisecond), advisory.WithKeepalive(100 * time.Millisecond)}},
		{"logger", sqllock.Postgres, []advisory.Option{advisory.WithLogger(nil)}},
		{"namespace", sqllock.MySQL, []advisory.Option{advisory.WithNamespace("")}},
	} {
		if _, err := advisory.New(db, c.d, c.opts...); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("%s: New = %v, want ErrInvalidOption", c.name, err)
		}
	}
	if _, err := advisory.New(nil, sqllock.Postgres); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("nil db: %v", err)
	}
	l, err := advisory.New(db, sqllock.Postgres)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryAcquire(context.Background(), "x", sqllock.WithLeaseTTL(time.Second)); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("WithTTL: %v, want ErrInvalidOption", err)
	}
	if _, err := l.TryAcquire(context.Background(), ""); !errors.Is(err, sqllock.ErrInvalidName) {
		t.Errorf("empty name: %v, want ErrInvalidName", err)
	}
}

// TestOwnerTryAcquireDoesNotWait: a TryAcquire with an owner key whose first
// acquisition is still blocked on the server returns ErrNotAcquired at once instead
// of waiting with it.
func TestOwnerTryAcquireDoesNotWait(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		l := newLocker(t, testdb.Open(t, d), d)
		other := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		holder, err := other.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		own := sqllock.WithOwner("job-1")
		blocked := make(chan error, 1)
		go func() {
			le, err := l.Acquire(ctx, name, own)
			if err == nil {
				err = le.Release(ctx)
			}
			blocked <- err
		}()
		// Wait until the blocked Acquire is queued on the server.
		admin := testdb.Open(t, d)
		deadline := time.Now().Add(10 * time.Second)
		for serverWaiters(t, admin, d, l, name) == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the owner's Acquire never queued on the server")
			}
			time.Sleep(5 * time.Millisecond) // polling the server: no signal exists
		}
		start := time.Now()
		le, err := l.TryAcquire(ctx, name, own)
		if err == nil {
			le.Release(ctx)
		}
		if !errors.Is(err, sqllock.ErrNotAcquired) || time.Since(start) > time.Second {
			t.Errorf("TryAcquire of the same owner while its Acquire waits: %v after %v; want ErrNotAcquired at once", err, time.Since(start))
		}
		if err := holder.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-blocked; err != nil {
			t.Fatalf("the blocked Acquire: %v", err)
		}
	})
}

// serverWaiters counts sessions waiting on the server for the lock of name.
func serverWaiters(t testing.TB, admin *sql.DB, d sqllock.Dialect, l *advisory.Locker, name string) int {
	t.Helper()
	ctx := testdb.Context(t, 10*time.Second)
	var n int
	var err error
	if d == sqllock.Postgres {
		k1, k2 := l.PostgresKeys(name)
		err = admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
AND classid = $1::int4::oid AND objid = $2::int4::oid AND objsubid = 2 AND NOT granted`, k1, k2).Scan(&n)
	} else {
		var my string
		if my, err = l.MySQLLockName(ctx, name); err == nil {
			n, err = testdb.Running(ctx, admin, d, "GET_LOCK('"+my+"'")
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCancelLeavesNoWaiter: when a blocked Acquire returns after its context was
// cancelled, its wait has ended on the server too. A waiter left queued there (as
// happens when the driver merely closes the socket of a session blocked in GET_LOCK)
// could be granted the lock after the holder releases and keep it until the server
// notices the dead client, so a third client would find the lock taken.
func TestCancelLeavesNoWaiter(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		l := newLocker(t, testdb.Open(t, d), d)
		other := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		for round := 0; round < 3; round++ {
			holder, err := other.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithCancel(ctx)
			res := make(chan error, 1)
			go func() {
				le, err := l.Acquire(wctx, name)
				if err == nil {
					le.Release(ctx)
				}
				res <- err
			}()
			deadline := time.Now().Add(10 * time.Second)
			for serverWaiters(t, admin, d, l, name) == 0 {
				if time.Now().After(deadline) {
					t.Fatal("the Acquire never queued on the server")
				}
				time.Sleep(5 * time.Millisecond) // polling the server: no signal exists
			}
			cancel()
			if err := <-res; !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
				t.Fatalf("cancelled Acquire: %v", err)
			}
			if n := serverWaiters(t, admin, d, l, name); n != 0 {
				t.Fatalf("round %d: %d waiters still queued on the server after the cancelled Acquire returned", round, n)
			}
			if err := holder.Release(ctx); err != nil {
				t.Fatal(err)
			}
			after, err := other.TryAcquire(ctx, name)
			if err != nil {
				t.Fatalf("round %d: TryAcquire right after the holder released: %v (the cancelled waiter got the lock)", round, err)
			}
			after.Release(ctx)
		}
	})
}
