package advisory_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// epochOf is the epoch a PostgreSQL token was drawn in (tokens are epoch * 2^44 plus
// a sequence value).
func epochOf(tok int64) int64 { return tok >> 44 }

// TestEpochTokens: on PostgreSQL a token costs no commit of its own. The first token of
// a server run records the run's epoch (here in a fresh schema: epoch 1); session and
// transaction locks draw from the same sequence, so their tokens interleave strictly
// increasing; a run that finds only earlier runs' epochs (made here by aging the
// recorded start, as a restart would) records the next epoch, and its tokens are
// larger than all before.
func TestEpochTokens(t *testing.T) {
	d := sqllock.Postgres
	ctx := testdb.Context(t, time.Minute)
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	l := newLocker(t, db, d)
	name := testdb.Name(t)
	var last int64
	draw := func(wantEpoch int64) {
		t.Helper()
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		tok := le.Token()
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		txTok, err := l.AcquireTx(ctx, tx, name)
		if err != nil {
			t.Fatal(err)
		}
		for _, tk := range []int64{tok, txTok} {
			if tk <= last {
				t.Fatalf("token %d after %d: not increasing", tk, last)
			}
			if e := epochOf(tk); e != wantEpoch {
				t.Fatalf("token %d is of epoch %d, want %d", tk, e, wantEpoch)
			}
			last = tk
		}
	}
	draw(1)
	draw(1)
	var n int
	if err := db.QueryRowContext(ctx, "SELECT count(*) FROM sqllock_epoch WHERE started = pg_postmaster_start_time() AND epoch = 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("the run's epoch row: %d rows, %v", n, err)
	}
	// As after a restart: the recorded epoch belongs to an earlier run. The sequence
	// is set back too, as a crash may do.
	if _, err := db.ExecContext(ctx, "UPDATE sqllock_epoch SET started = started - interval '1 day'"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "SELECT setval('sqllock_token_seq', 1)"); err != nil {
		t.Fatal(err)
	}
	draw(2)
	checkWithoutToken(ctx, t, db, d, name)
}

// TestTokensAcrossCrash: a token drawn by a lease held while the server is killed
// (SIGKILL, no shutdown: the sequence's unflushed increments are lost) is smaller
// than every token drawn after the restart, on both databases (locktest).
func TestTokensAcrossCrash(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.TokensAcrossCrash(t, d, func(t testing.TB, db *sql.DB) sqllock.Locker { return newLocker(t, db, d) })
	})
}

// TestEpochTokensMySQL: on MySQL a token costs no commit either: it is drawn from the
// server's UUID_SHORT() under the epoch of the server's run (sqllock_epoch; the run's
// row in the MEMORY table sqllock_runs). The first token of a run records the run's
// epoch (in a fresh database: epoch 1); emptying sqllock_runs, as every start of the
// server does, makes the next draw record
// the next epoch, whose tokens are larger than all before; a counter whose low bits
// are used up takes a new epoch too, and so does, with WithGaleraSingleWriter, a
// counter whose epoch is older than the largest recorded (a Galera node clients
// failed back to). A draw that had to record an epoch took the lock exactly once (another session
// gets it after the Release).
func TestEpochTokensMySQL(t *testing.T) {
	d := sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	l := newLocker(t, db, d)
	other := newLocker(t, db, d)
	name := testdb.Name(t)
	var last int64
	draw := func(wantEpoch int64) {
		t.Helper()
		for _, try := range []bool{false, true, false} {
			le, err := acquire(ctx, l, name, try)
			if err != nil {
				t.Fatal(err)
			}
			tok := le.Token()
			if tok <= last {
				t.Fatalf("token %d after %d: not increasing", tok, last)
			}
			if e := epochOf(tok); e != wantEpoch {
				t.Fatalf("token %d is of epoch %d, want %d", tok, e, wantEpoch)
			}
			last = tok
			if try { // held: another Locker is refused
				if _, err := other.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
					t.Fatalf("TryAcquire of a held lock: %v", err)
				}
			}
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// Released once is free: no nested GET_LOCK was left on the session.
			ole, err := other.TryAcquire(ctx, name+"/other")
			if err != nil {
				t.Fatal(err)
			}
			ole.Release(ctx)
			ole, err = other.TryAcquire(ctx, name)
			if err != nil {
				t.Fatalf("after Release: %v", err)
			}
			if ole.Token() <= last {
				t.Fatalf("the other Locker's token %d after %d", ole.Token(), last)
			}
			last = ole.Token()
			if err := ole.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	exec := func(q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	draw(1)
	exec("DELETE FROM sqllock_runs") // what a start of the server does
	draw(2)
	exec("UPDATE sqllock_runs SET base = base - 17592186044415") // the counter's bits used up
	draw(3)
	// Another Galera node recorded a newer epoch (sqllock_epoch is replicated,
	// sqllock_runs is not). Without the Galera promise the Locker goes on in its
	// server's run (on servers that replicate sqllock_runs another server's newer
	// run would come with its row); with it, every draw checks the epoch and takes
	// a newer one (the other node's is a minute old: clients failed back from it; a
	// fresher one is refused, see fence's TestMySQLNewestEpochOtherNode).
	exec("INSERT INTO sqllock_epoch (epoch, created_at) VALUES (10, UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE)")
	draw(3)
	l = newLocker(t, db, d, advisory.WithGaleraSingleWriter())
	other = newLocker(t, db, d, advisory.WithGaleraSingleWriter())
	draw(11)
	var n int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqllock_epoch").Scan(&n); err != nil || n != 5 {
		t.Fatalf("sqllock_epoch: %d rows (%v), want 5: one per new run and the other node's", n, err)
	}
	checkWithoutToken(ctx, t, db, d, name)
}

// TestEpochRecordedUnderContentionMySQL: the first draw of a server run records the
// run's epoch while other clients wait for the same lock. A statement that reads the
// MEMORY table sqllock_runs holds its table lock while it runs, so a waiter that held
// it while waiting would deadlock with the writer of the epoch: the waiting GET_LOCK
// reads no table. Here the server's run is dropped (as a restart does) while
// waiters of other pools queue behind a holder; every waiter must get the lock in
// turn, quickly, with tokens of the next epoch in increasing order.
func TestEpochRecordedUnderContentionMySQL(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	name := testdb.Name(t)
	holder := newLocker(t, testdb.Open(t, d), d)
	held, err := holder.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 4
	type result struct {
		tok int64
		err error
	}
	got := make(chan result, waiters)
	for range waiters {
		l := newLocker(t, testdb.Open(t, d), d)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			le, err := l.Acquire(wctx, name)
			if err != nil {
				got <- result{err: err}
				return
			}
			tok := le.Token()
			got <- result{tok, le.Release(wctx)}
		}()
	}
	for serverWaiters(t, admin, d, holder, name) < waiters { // polls the server: no signal exists
		if ctx.Err() != nil {
			t.Fatal("the waiters never queued")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := admin.ExecContext(ctx, "DELETE FROM sqllock_runs"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	before := held.Token()
	for range waiters {
		r := <-got
		if r.err != nil {
			t.Fatal(r.err)
		}
		if r.tok <= before || epochOf(r.tok) <= epochOf(before) {
			t.Fatalf("token %d after the run's counter was dropped, %d before", r.tok, before)
		}
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("%d waiters took %v to get the lock in turn", waiters, took)
	}
}

// checkWithoutToken: a WithoutToken Locker's lease of name has token 0 (it draws
// nothing).
func checkWithoutToken(ctx context.Context, t *testing.T, db *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	le, err := newLocker(t, db, d, advisory.WithoutToken()).Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() != 0 {
		t.Fatalf("WithoutToken: token %d", le.Token())
	}
}

// acquire is l.TryAcquire if try, else l.Acquire.
func acquire(ctx context.Context, l *advisory.Locker, name string, try bool) (sqllock.Lease, error) {
	if try {
		return l.TryAcquire(ctx, name)
	}
	return l.Acquire(ctx, name)
}
