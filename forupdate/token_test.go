package forupdate_test

import (
	"context"
	"database/sql"
	"encoding/hex"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// TestTokensAcrossCrash: a token drawn by a lease whose transaction never committed
// (the server is killed with SIGKILL while it is held, so neither the transaction
// nor the sequence's WAL or the AUTO_INCREMENT counter need have reached the disk) is
// smaller than every token drawn after the restart: tokens carry the epoch of the
// server's run (fence.EpochPostgres; on MySQL the AUTO_INCREMENT counter raised to
// the run's epoch, see TestTokensNewRun). Before, InnoDB handed out the same value
// again after a crash (seen on MySQL 9.7: 42 before, 42 after).
func TestTokensAcrossCrash(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.TokensAcrossCrash(t, d, func(t testing.TB, db *sql.DB) sqllock.Locker {
			return newLocker(t, db, d)
		})
	})
}

// TestTokensNewRun: on MySQL each run of the server has an epoch, and a session
// raises sqllock_rowlock's AUTO_INCREMENT to epoch << 44 before it draws a token.
// What a restart does to the run is done here by hand (the server empties the MEMORY
// table sqllock_runs when it starts): a new session then records a new epoch, one
// more, and its tokens are above every token of the earlier run. Sessions of the
// earlier run are gone after a real restart; here a new pool stands for them.
func TestTokensNewRun(t *testing.T) {
	d := sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	// A schema of its own: other tests' runs and epochs stay apart.
	admin := testdb.OpenIsolatedMigrated(ctx, t, d)
	name := testdb.Name(t)
	take := func() int64 {
		t.Helper()
		l := newLocker(t, admin, d) // a Locker of its own: its sessions check the run
		le, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
		return le.Token()
	}
	before := take()
	var epoch int64
	if err := admin.QueryRowContext(ctx, "SELECT MAX(epoch) FROM sqllock_runs").Scan(&epoch); err != nil {
		t.Fatalf("the run's epoch: %v", err)
	}
	if before>>44 != epoch || before <= epoch<<44 {
		t.Fatalf("token %d (epoch part %d) in run %d; want one above %d", before, before>>44, epoch, epoch<<44)
	}
	if _, err := admin.ExecContext(ctx, "DELETE FROM sqllock_runs"); err != nil { // what a restart does
		t.Fatal(err)
	}
	after := take()
	t.Logf("token %d in run %d, %d after the run ended", before, epoch, after)
	if after>>44 != epoch+1 {
		t.Errorf("token %d after the run ended: epoch part %d, want %d", after, after>>44, epoch+1)
	}
	if after <= before {
		t.Errorf("token %d after the run ended, %d before", after, before)
	}
}

// queuedBehind counts the sessions queued on the server for the row lock of key,
// held by session holder: on PostgreSQL the sessions blocked by the holder or, in
// turn, by one of those (a second waiter waits for the first one's tuple lock); on
// MySQL the transactions whose waiting lock request is on the row of key
// (performance_schema.data_lock_waits and data_locks on MySQL 8+,
// information_schema.INNODB_LOCK_WAITS and INNODB_LOCKS on MariaDB).
func queuedBehind(t testing.TB, admin *sql.DB, d sqllock.Dialect, holder int64, key []byte) int {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	q := `WITH RECURSIVE q(pid) AS (
  SELECT pid FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))
  UNION
  SELECT a.pid FROM pg_stat_activity a JOIN q ON q.pid = ANY(pg_blocking_pids(a.pid))
) SELECT count(*) FROM q`
	arg := any(holder)
	if d == sqllock.MySQL {
		f, err := testdb.FlavorOf(ctx, admin, d)
		if err != nil {
			t.Fatal(err)
		}
		arg = "0x" + hex.EncodeToString(key)
		q = `SELECT COUNT(DISTINCT w.REQUESTING_ENGINE_TRANSACTION_ID) FROM performance_schema.data_lock_waits w
JOIN performance_schema.data_locks l ON l.ENGINE_LOCK_ID = w.REQUESTING_ENGINE_LOCK_ID
WHERE l.OBJECT_SCHEMA = DATABASE() AND l.OBJECT_NAME = 'sqllock_rowlock' AND l.INDEX_NAME = 'PRIMARY'
AND LOWER(l.LOCK_DATA) = ?`
		if f == testdb.FlavorMariaDB {
			q = `SELECT COUNT(DISTINCT w.requesting_trx_id) FROM information_schema.INNODB_LOCK_WAITS w
JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id
WHERE l.lock_table = CONCAT('` + "`" + `', DATABASE(), '` + "`.`sqllock_rowlock`" + `') AND l.lock_index = 'PRIMARY'
AND LOWER(l.lock_data) = ?`
		}
	}
	var n int
	if err := admin.QueryRowContext(ctx, q, arg).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitQueued waits until want sessions are queued for the row of key behind holder.
func waitQueued(t testing.TB, admin *sql.DB, d sqllock.Dialect, holder int64, key []byte, want int) {
	t.Helper()
	start := time.Now()
	for {
		n := queuedBehind(t, admin, d, holder, key)
		if n == want {
			return
		}
		if time.Since(start) > 20*time.Second {
			t.Fatalf("%d sessions queued for the lock after %v, want %d", n, time.Since(start), want)
		}
		// Polling the server, which sends no signal. InnoDB refreshes its
		// information_schema lock tables only when they were not read for 100 ms.
		pause := 20 * time.Millisecond
		if d == sqllock.MySQL {
			pause = 150 * time.Millisecond
		}
		time.Sleep(pause)
	}
}

// TestTokensDrawnOnceGranted: the token is drawn in the locking statement, but only
// once the row lock is granted, so tokens grow in the order in which the lock is
// granted. Two waiters queue (seen on the server) behind a holder; while both wait,
// another name is locked, which draws from the same counter (the PostgreSQL token
// sequence, the table's AUTO_INCREMENT); then the holder releases. Each waiter's
// token must be larger than the holder's, than the other name's (a token drawn
// before the wait would be smaller), and than that of the waiter granted before it.
// With and without a ctx deadline (the lock_timeout and server wait bound forms),
// and through WithLock.
func TestTokensDrawnOnceGranted(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, form := range []string{"deadline", "no-deadline", "WithLock"} {
			t.Run(form, func(t *testing.T) {
				admin := testdb.Open(t, d)
				holders := newLocker(t, testdb.Open(t, d), d)
				waiters := newLocker(t, testdb.Open(t, d), d)
				name, other := testdb.Name(t), testdb.Name(t)+"/other"
				key := sqllockKey(name)
				ctx := testdb.Context(t, time.Minute)
				wctx, cancel := context.WithCancel(ctx)
				if form != "deadline" {
					wctx, cancel = context.WithCancel(context.WithoutCancel(ctx))
				}
				for _, n := range []string{name, other} { // rows exist: no creation below
					le, err := holders.Lock(ctx, n)
					if err != nil {
						t.Fatal(err)
					}
					if err := le.Release(ctx); err != nil {
						t.Fatal(err)
					}
				}
				holder, err := holders.Lock(ctx, name)
				if err != nil {
					t.Fatal(err)
				}

				type result struct {
					token int64
					err   error
				}
				results := make(chan result, 2)
				release := make(chan struct{}) // each receive lets one granted waiter release
				var wg sync.WaitGroup
				var once sync.Once
				done := func() { // lets every waiter go, and waits for them
					once.Do(func() { close(release) })
					holder.Release(ctx)
					cancel()
					wg.Wait()
				}
				defer done()
				for i := 1; i <= 2; i++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if form == "WithLock" {
							var tok int64
							err := waiters.WithLock(wctx, name, func(ctx context.Context, tx *sql.Tx) error {
								row := tx.QueryRowContext(ctx, testdb.Rebind(d, "SELECT token FROM sqllock_rowlock WHERE lock_key = ?"), key)
								if err := row.Scan(&tok); err != nil {
									return err
								}
								results <- result{tok, nil}
								<-release
								return nil
							})
							if err != nil {
								results <- result{0, err}
							}
							return
						}
						le, err := waiters.Lock(wctx, name)
						if err != nil {
							results <- result{0, err}
							return
						}
						results <- result{le.Token(), nil}
						<-release
						if err := le.Release(ctx); err != nil {
							t.Error(err)
						}
					}()
					waitQueued(t, admin, d, holder.SessionID(), key, i)
				}
				o, err := holders.Lock(ctx, other)
				if err != nil {
					t.Fatal(err)
				}
				drawnWhileWaiting := o.Token()
				if err := o.Release(ctx); err != nil {
					t.Fatal(err)
				}
				if queued := queuedBehind(t, admin, d, holder.SessionID(), key); queued != 2 {
					t.Fatalf("%d waiters queued after the other name was locked, want 2", queued)
				}
				if err := holder.Release(ctx); err != nil {
					t.Fatal(err)
				}
				prev := holder.Token()
				for i := 0; i < 2; i++ {
					var r result
					select {
					case r = <-results:
					case <-ctx.Done():
						t.Fatal("waiter not granted")
					}
					if r.err != nil {
						t.Fatalf("waiter: %v", r.err)
					}
					t.Logf("granted %d: token %d (holder %d, other name %d while waiting)", i+1, r.token, holder.Token(), drawnWhileWaiting)
					if r.token <= drawnWhileWaiting {
						t.Errorf("waiter granted %d has token %d, not above %d, drawn while it waited: drawn before the wait", i+1, r.token, drawnWhileWaiting)
					}
					if r.token <= prev {
						t.Errorf("waiter granted %d has token %d, not above %d of the holder before it", i+1, r.token, prev)
					}
					prev = r.token
					release <- struct{}{}
				}
				done()
				if got := committedToken(t, admin, d, name); got != prev {
					t.Errorf("committed token %d, want %d (the last holder's)", got, prev)
				}
			})
		}
	})
}

// TestEpochTokensFallback: on PostgreSQL the locking statement draws the token with
// the epoch of the server's run, NULL while the run has none: then the acquisition
// records the epoch (fence.Drawn), draws again and stores that token. In a fresh
// schema the first acquisition records epoch 1; a run that finds only an earlier
// run's epoch (made here by aging the recorded start, as a restart would, the
// sequence set back as a crash may do) records epoch 2, and its tokens are larger.
// Every form that draws: Lock with and without a deadline, TryLock, TryAcquireAny;
// the committed token is the lease's.
func TestEpochTokensFallback(t *testing.T) {
	d := sqllock.Postgres
	ctx := testdb.Context(t, time.Minute)
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	l := newLocker(t, db, d)
	name := testdb.Name(t)
	noDeadline, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	forms := []struct {
		name string
		lock func() (*forupdate.Lease, error)
	}{
		{"Lock", func() (*forupdate.Lease, error) { return l.Lock(noDeadline, name) }},
		{"Lock with deadline", func() (*forupdate.Lease, error) { return l.Lock(ctx, name) }},
		{"TryLock", func() (*forupdate.Lease, error) { return l.TryLock(ctx, name) }},
		{"TryAcquireAny", func() (*forupdate.Lease, error) { return l.TryAcquireAny(ctx, []string{name}) }},
	}
	var last int64
	for i, f := range forms {
		epoch := int64(i + 1)
		if epoch > 1 {
			// As after a restart: the recorded epochs belong to earlier runs.
			if _, err := db.ExecContext(ctx, "UPDATE sqllock_epoch SET started = started - interval '1 day'"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, "SELECT setval('sqllock_token_seq', 1)"); err != nil {
				t.Fatal(err)
			}
		}
		for j := 0; j < 2; j++ { // the first records the epoch, the second finds it
			le, err := f.lock()
			if err != nil {
				t.Fatalf("%s: %v", f.name, err)
			}
			tok := le.Token()
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if tok <= last || tok>>44 != epoch {
				t.Fatalf("%s: token %d (epoch %d) after %d: want larger, of epoch %d", f.name, tok, tok>>44, last, epoch)
			}
			if got := committedToken(t, db, d, name); got != tok {
				t.Fatalf("%s: committed token %d, want the lease's %d", f.name, got, tok)
			}
			last = tok
		}
	}
	var n int64
	if err := db.QueryRowContext(ctx, "SELECT max(epoch) FROM sqllock_epoch").Scan(&n); err != nil || n != int64(len(forms)) {
		t.Fatalf("largest epoch %d (%v), want %d: one per run", n, err, len(forms))
	}
}
