package uniqueindex

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/testdb"
)

// TestSweepLocksOnlyItsRows: a sweep batch does not wait for live leases. While a
// transaction holds the row of a live lease (a Release or renewal in flight) and an
// uncommitted new lease row (an acquisition in flight), a batch deletes the expired
// rows and leaves both alone. On MySQL the delete must reach its rows by primary key
// only (checked with EXPLAIN): a full scan or an expires_at range scan locks live rows
// or index gaps and deadlocks with Release (seen in CI). On PostgreSQL an expired row
// locked by someone else (a takeover in flight) is skipped, not waited for.
func TestSweepLocksOnlyItsRows(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, time.Minute)
		// Rows expired 50 years ago, swept with a grace of 40: no other test's rows
		// qualify, whatever runs at the same time on the shared database.
		const grace = 40 * 365 * 24 * time.Hour
		ins := "INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at) " +
			"VALUES (?, ?, 'x', 1, 1, UTC_TIMESTAMP(6) - INTERVAL 51 YEAR, UTC_TIMESTAMP(6) - INTERVAL 50 YEAR)"
		if d == sqllock.Postgres {
			ins = "INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at) " +
				"VALUES ($1, $2, 'x', 1, 1, clock_timestamp() - interval '51 years', clock_timestamp() - interval '50 years')"
		}
		var dead []string
		for i := 0; i < 5; i++ {
			n := testdb.Name(t, "dead")
			if _, err := admin.ExecContext(ctx, ins, namekey.Key(n), []byte(n)); err != nil {
				t.Fatal(err)
			}
			dead = append(dead, n)
		}
		l := newLocker(t, testdb.Open(t, d), d)
		live, err := l.Acquire(ctx, testdb.Name(t, "live"))
		if err != nil {
			t.Fatal(err)
		}
		defer live.Release(ctx)

		tx, err := admin.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		var one int
		if err := tx.QueryRowContext(ctx, testdb.Rebind(d, "SELECT 1 FROM sqllock_lease WHERE lock_key = ? FOR UPDATE"), namekey.Key(live.Name())).Scan(&one); err != nil {
			t.Fatal(err)
		}
		fresh := testdb.Name(t, "inflight")
		insLive := "INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at) " +
			"VALUES (?, ?, 'x', 1, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)"
		if d == sqllock.Postgres {
			insLive = "INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at) " +
				"VALUES ($1, $2, 'x', 1, 1, clock_timestamp(), clock_timestamp() + interval '1 hour')"
		}
		if _, err := tx.ExecContext(ctx, insLive, namekey.Key(fresh), []byte(fresh)); err != nil {
			t.Fatal(err)
		}
		skipped := 0
		if d == sqllock.Postgres {
			// A takeover of an expired row in flight: that row is skipped.
			if err := tx.QueryRowContext(ctx, "SELECT 1 FROM sqllock_lease WHERE lock_key = $1 FOR UPDATE", namekey.Key(dead[0])).Scan(&one); err != nil {
				t.Fatal(err)
			}
			skipped = 1
		}
		if d == sqllock.MySQL {
			explainDeletePrimary(t, admin, dead)
		}

		s, err := NewSweeper(testdb.Open(t, d), d, grace)
		if err != nil {
			t.Fatal(err)
		}
		// Bounded: a batch that waited for the open transaction would time out.
		n, more, err := s.SweepBatch(testdb.Context(t, 20*time.Second), 1000)
		if err != nil {
			t.Fatalf("sweep while live rows are locked: %v", err)
		}
		if n < len(dead)-skipped || more {
			t.Errorf("sweep deleted %d rows (more %v), want >= %d and no more", n, more, len(dead)-skipped)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		left := 0
		for _, name := range dead {
			var c int
			if err := admin.QueryRowContext(ctx, testdb.Rebind(d, "SELECT count(*) FROM sqllock_lease WHERE lock_key = ?"), namekey.Key(name)).Scan(&c); err != nil {
				t.Fatal(err)
			}
			left += c
		}
		if left != skipped {
			t.Errorf("%d expired rows left, want %d", left, skipped)
		}
		if skipped > 0 {
			if n, _, err := s.SweepBatch(ctx, 1000); err != nil || n < 1 {
				t.Errorf("sweep after the takeover ended: %d, %v", n, err)
			}
		}
		if err := live.(*Lease).Refresh(ctx); err != nil {
			t.Errorf("live lease after the sweep: %v", err)
		}
		// Batches are bounded.
		for i := 0; i < 3; i++ {
			n := testdb.Name(t, "dead")
			if _, err := admin.ExecContext(ctx, ins, namekey.Key(n), []byte(n)); err != nil {
				t.Fatal(err)
			}
		}
		if n, more, err := s.SweepBatch(ctx, 2); err != nil || n != 2 || !more {
			t.Errorf("batch of 2 out of 3: deleted %d, more %v, %v", n, more, err)
		}
		if n, more, err := s.SweepBatch(ctx, 2); err != nil || n != 1 || more {
			t.Errorf("last batch: deleted %d, more %v, %v", n, more, err)
		}
	})
}

// explainDeletePrimary checks that MySQL plans the sweep's DELETE as a primary key
// access, whatever the table's size and statistics.
func explainDeletePrimary(t *testing.T, db *sql.DB, names []string) {
	t.Helper()
	for _, k := range []int{1, len(names)} {
		_, del := rowlease.SweepStatementsMySQL("sqllock_lease", "token", k)
		q := "EXPLAIN FORMAT=TRADITIONAL " + del
		args := []any{int64(0)}
		for _, n := range names[:k] {
			args = append(args, namekey.Key(n))
		}
		rows, err := db.QueryContext(testdb.Context(t, 30*time.Second), q, args...)
		if err != nil {
			t.Fatal(err)
		}
		for _, row := range testdb.RowMaps(t, rows) {
			plan := map[string]string{}
			var desc []string
			for c, v := range row {
				plan[c] = v.String
				desc = append(desc, fmt.Sprintf("%s=%s", c, v.String))
			}
			if _, ok := plan["type"]; !ok {
				t.Fatalf("EXPLAIN without a type column: %s", strings.Join(desc, " "))
			}
			if plan["type"] == "ALL" || plan["type"] == "index" || (plan["key"] != "" && plan["key"] != "PRIMARY") {
				t.Errorf("sweep DELETE with %d keys is not a primary key access: %s", k, strings.Join(desc, " "))
			}
		}
	}
}

// TestMySQLReleaseKeepsExpiry: on MySQL a release frees the row by its hold count
// and leaves expires_at (and so expires_min, the minute the reaper's index holds)
// as it was, so that locking and unlocking a name does not rewrite that index entry
// each time (migration mysql/0007). The freed row is nobody's all the same: Holder
// and ForceRelease find no live lease, a sweep leaves it until that expiry is past
// its grace and then deletes it, and the sweep's candidates are read through the
// index on the minute, not by a full scan.
func TestMySQLReleaseKeepsExpiry(t *testing.T) {
	const d = sqllock.MySQL
	testdb.CheckLeaks(t)
	admin := testdb.Open(t, d)
	ctx := testdb.Context(t, time.Minute)
	l := newLocker(t, testdb.Open(t, d), d, WithTTL(10*time.Minute))
	name := testdb.Name(t)
	key := namekey.Key(name)
	le, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	const rowQ = "SELECT holds, owner, expires_at, expires_min, TIMESTAMPDIFF(MINUTE, '1970-01-01 00:00:00', expires_at) FROM sqllock_lease WHERE lock_key = ?"
	var holds, minute, want int64
	var owner []byte
	var held, freed string
	if err := admin.QueryRowContext(ctx, rowQ, key).Scan(&holds, &owner, &held, &minute, &want); err != nil {
		t.Fatal(err)
	}
	if holds != 1 || minute != want {
		t.Fatalf("held row: holds %d, expires_min %d, want 1 and %d", holds, minute, want)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := admin.QueryRowContext(ctx, rowQ, key).Scan(&holds, &owner, &freed, &minute, &want); err != nil {
		t.Fatal(err)
	}
	if holds != 0 || len(owner) != 0 || freed != held || minute != want {
		t.Errorf("freed row: holds %d, owner %q, expires_at %s (held: %s), expires_min %d; want 0, empty, unchanged, %d",
			holds, owner, freed, held, minute, want)
	}
	if h, err := l.Holder(ctx, name); !errors.Is(err, sqllock.ErrNoHolder) {
		t.Errorf("Holder of a released name: %+v, %v, want ErrNoHolder", h, err)
	}
	if err := ForceRelease(ctx, admin, d, name, false); !errors.Is(err, sqllock.ErrNotHeld) {
		t.Errorf("ForceRelease of a released name: %v, want ErrNotHeld", err)
	}

	// Sweeps with a grace of 5 minutes: the freed row's expiry (10 minutes ahead)
	// keeps it; 6 minutes in the past, it goes. Other tests' rows are younger.
	s, err := NewSweeper(admin, d, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.SweepBatch(ctx, 1000); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := leaseRow(t, admin, d, name); !ok {
		t.Fatal("a sweep deleted a released row whose expiry is still ahead")
	}
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_lease SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 6 MINUTE WHERE lock_key = ?", key); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.SweepBatch(ctx, 1000); err != nil {
		t.Fatal(err)
	}
	if _, _, _, ok := leaseRow(t, admin, d, name); ok {
		t.Error("a sweep kept a released row expired 6 minutes ago (grace 5)")
	}

	rows, err := admin.QueryContext(ctx, "EXPLAIN FORMAT=TRADITIONAL "+rowlease.CandidatesSQLMySQL("sqllock_lease", true), int64(0), int64(0), 10)
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range testdb.RowMaps(t, rows) {
		if row["key"].String != "sqllock_lease_expires_min" || row["type"].String == "ALL" {
			t.Errorf("the sweep's candidates are not read by the index on the minute of expiry: type %s key %s", row["type"].String, row["key"].String)
		}
	}
}
