package advisory_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/migrations"
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
	db := testdb.OpenIsolated(t, d)
	if err := migrations.Up(ctx, db, d); err != nil {
		t.Fatal(err)
	}
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
	// WithoutToken draws nothing.
	lw := newLocker(t, db, d, advisory.WithoutToken())
	le, err := lw.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() != 0 {
		t.Fatalf("WithoutToken: token %d", le.Token())
	}
}

// TestTokensAcrossCrash: a token drawn by a lease held while the server is killed
// (SIGKILL, no shutdown: the sequence's unflushed increments are lost) is smaller
// than every token drawn after the restart, on both databases (locktest).
func TestTokensAcrossCrash(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.TokensAcrossCrash(t, d, func(t testing.TB, db *sql.DB) sqllock.Locker { return newLocker(t, db, d) })
	})
}
