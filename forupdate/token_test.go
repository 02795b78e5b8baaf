package forupdate_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// TestTokensAcrossCrash: a token drawn by a lease whose transaction never committed
// (the server is killed with SIGKILL while it is held, so neither the transaction
// nor the sequence's WAL or the AUTO_INCREMENT counter need have reached the disk)
// is smaller than every token drawn after the restart: tokens carry the epoch of
// the server's run (fence.EpochPostgres; on MySQL sqllock_run, a MEMORY table the
// restart empties, over the durable sqllock_epoch). Before, MySQL 9.7 handed out
// token 42 before the crash and 42 again after it.
func TestTokensAcrossCrash(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.TokensAcrossCrash(t, d, func(t testing.TB, db *sql.DB) sqllock.Locker { return newLocker(t, db, d) })
	})
}

// TestTokensAfterNodeSwitchMySQL: a name whose last token carries a newer epoch than
// the run this client talks to (what clients that fail over from one Galera node to
// another meet: each node keeps its own run epoch) gets a larger token still: the
// run records a newer epoch first.
func TestTokensAfterNodeSwitchMySQL(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	l := newLocker(t, testdb.Open(t, d), d)
	name := testdb.Name(t)
	le, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Another node's newer epoch: a row of sqllock_epoch above every other, and the
	// name's last token drawn under it.
	var top int64
	if err := admin.QueryRowContext(ctx, "SELECT COALESCE(MAX(epoch), 0) + 10 FROM sqllock_epoch").Scan(&top); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ExecContext(ctx, "INSERT INTO sqllock_epoch (epoch, created_at) VALUES (?, UTC_TIMESTAMP(6))", top); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_rowlock SET epoch = ? WHERE name = ?", top, []byte(name)); err != nil {
		t.Fatal(err)
	}
	before, err := l.CommittedToken(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	le, err = l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() <= before {
		t.Fatalf("token %d after a newer epoch's token %d", le.Token(), before)
	}
	t.Logf("newer epoch's token %d, then %d", before, le.Token())
}

// TestEpochRecordedUnderContention: the first lease of a server run records the
// run's epoch while other clients wait for the same row. A locking read that read
// the MEMORY table sqllock_run held a table lock on it while it waited, and the new
// holder's write of the epoch waited for those readers: a deadlock until the lock
// wait timeout. Here the run's epoch is dropped (as a restart does) while three
// waiters queue behind a holder; every waiter must get the lock in turn, quickly.
func TestEpochRecordedUnderContention(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	name := testdb.Name(t)
	holder := newLocker(t, testdb.Open(t, d), d)
	held, err := holder.Lock(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 3
	got := make(chan error, waiters)
	for range waiters {
		l := newLocker(t, testdb.Open(t, d), d)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			le, err := l.Acquire(wctx, name)
			if err == nil {
				err = le.Release(wctx)
			}
			got <- err
		}()
	}
	queued := time.Now()
	for n := 0; n < waiters-1; { // two or more waiting: the one that gets the lock next records the epoch
		if n, err = testdb.BlockedBy(ctx, admin, d, held.SessionID()); err != nil {
			t.Fatal(err)
		}
		if ctx.Err() != nil {
			t.Fatal("the waiters never queued")
		}
	}
	t.Logf("waiters queued after %v", time.Since(queued).Round(time.Millisecond))
	if _, err := admin.ExecContext(ctx, "DELETE FROM sqllock_run"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for range waiters {
		if err := <-got; err != nil {
			t.Fatalf("a waiter: %v", err)
		}
	}
	took := time.Since(start)
	t.Logf("three hand-offs after the epoch was dropped: %v", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Errorf("three hand-offs took %v", took)
	}
}

// TestEpochStable: once a run has its epoch, acquisitions (by new Lockers too) do
// not record new ones: sqllock_epoch grows once per server run, not per lease.
func TestEpochStable(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	name := testdb.Name(t)
	acquire := func() {
		t.Helper()
		l := newLocker(t, testdb.Open(t, d), d)
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	acquire() // the run has an epoch from here on
	epochs := func() (n int64) {
		t.Helper()
		if err := admin.QueryRowContext(ctx, "SELECT COALESCE(MAX(epoch), 0) FROM sqllock_epoch").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := epochs()
	for range 10 {
		acquire()
	}
	if after := epochs(); after != before {
		t.Fatalf("10 acquisitions in one run moved the epoch from %d to %d", before, after)
	}
}
