package uniqueindex

import (
	"database/sql"
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
		args := []any{int64(0)}
		for _, n := range names[:k] {
			args = append(args, namekey.Key(n))
		}
		for _, row := range testdb.ExplainMySQL(testdb.Context(t, 30*time.Second), t, db, del, args...) {
			plan := map[string]string{}
			var desc []string
			for c, v := range row {
				plan[c] = v.String
				desc = append(desc, fmt.Sprintf("%s=%s", c, v.String))
			}
			if plan["type"] == "ALL" || plan["type"] == "index" || (plan["key"] != "" && plan["key"] != "PRIMARY") {
				t.Errorf("sweep DELETE with %d keys is not a primary key access: %s", k, strings.Join(desc, " "))
			}
		}
	}
}

// TestMySQLSweepIndex: on MySQL the reaper reads its candidates through the index
// on acquired_min, the minute of acquired_at (migration mysql/0007), which a renewal
// or a release leaves alone (expires_at, which they move, is no longer indexed). A
// released row is swept once its expiry (the release's time) is past the grace, a
// live lease acquired long ago never is, and the plan uses the index.
func TestMySQLSweepIndex(t *testing.T) {
	const d = sqllock.MySQL
	testdb.CheckLeaks(t)
	admin := testdb.Open(t, d)
	ctx := testdb.Context(t, time.Minute)
	l := newLocker(t, testdb.Open(t, d), d, WithTTL(10*time.Minute))
	minutes := func(name string) (acq, want int64) {
		t.Helper()
		if err := admin.QueryRowContext(ctx, "SELECT acquired_min, TIMESTAMPDIFF(MINUTE, '1970-01-01 00:00:00', acquired_at) FROM sqllock_lease WHERE lock_key = ?",
			namekey.Key(name)).Scan(&acq, &want); err != nil {
			t.Fatal(err)
		}
		return acq, want
	}
	// A live lease acquired 6 minutes ago (the test moves acquired_at back), and a
	// released one.
	oldLive, freed := testdb.Name(t, "live"), testdb.Name(t, "freed")
	live, err := l.Acquire(ctx, oldLive)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Release(ctx)
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_lease SET acquired_at = UTC_TIMESTAMP(6) - INTERVAL 6 MINUTE WHERE lock_key = ?", namekey.Key(oldLive)); err != nil {
		t.Fatal(err)
	}
	before, _ := minutes(oldLive)
	if err := live.(*Lease).Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if acq, want := minutes(oldLive); acq != want || acq != before {
		t.Errorf("after a renewal: acquired_min %d, want %d (the minute of acquired_at, unchanged from %d)", acq, want, before)
	}

	le, err := l.Acquire(ctx, freed)
	if err != nil {
		t.Fatal(err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if acq, want := minutes(freed); acq != want {
		t.Errorf("after a release: acquired_min %d, want %d", acq, want)
	}

	// A sweep with a grace of 5 minutes keeps both; once the released row's
	// acquisition and expiry are 6 minutes old it goes, the live lease stays.
	s, err := NewSweeper(admin, d, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	sweep := func() {
		t.Helper()
		for more := true; more; {
			var err error
			if _, more, err = s.SweepBatch(ctx, 1000); err != nil {
				t.Fatal(err)
			}
		}
	}
	sweep()
	if _, _, _, ok := leaseRow(t, admin, d, freed); !ok {
		t.Fatal("a sweep deleted a row released less than the grace ago")
	}
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_lease SET acquired_at = UTC_TIMESTAMP(6) - INTERVAL 7 MINUTE, expires_at = UTC_TIMESTAMP(6) - INTERVAL 6 MINUTE WHERE lock_key = ?", namekey.Key(freed)); err != nil {
		t.Fatal(err)
	}
	sweep()
	if _, _, _, ok := leaseRow(t, admin, d, freed); ok {
		t.Error("a sweep kept a row released 6 minutes ago (grace 5)")
	}
	if _, _, expired, ok := leaseRow(t, admin, d, oldLive); !ok || expired {
		t.Errorf("a sweep touched a live lease acquired 6 minutes ago: present %v, expired %v", ok, expired)
	}
	if err := live.(*Lease).Refresh(ctx); err != nil {
		t.Errorf("the live lease after the sweeps: %v", err)
	}

	for _, row := range testdb.ExplainMySQL(ctx, t, admin, rowlease.CandidatesSQLMySQL("sqllock_lease", true), int64(0), int64(0), 10) {
		if row["key"].String != "sqllock_lease_acquired_min" || row["type"].String == "ALL" {
			t.Errorf("the sweep's candidates are not read through the index on acquired_min: type %s key %s", row["type"].String, row["key"].String)
		}
	}
}

// TestTakeoverExpiry: a lease that takes over a row freed by a lease with a longer
// TTL expires after its own TTL, through the full attempt and (MySQL) through the
// UPDATE of a row the Locker was granted last: a holder that dies is replaced after
// its TTL, not the previous holder's.
func TestTakeoverExpiry(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		long := newLocker(t, testdb.Open(t, d), d, WithTTL(10*time.Minute))
		short := newLocker(t, testdb.Open(t, d), d, WithTTL(2*time.Second))
		for _, takeFree := range []bool{false, true} {
			name := testdb.Name(t, fmt.Sprint("takefree-", takeFree))
			if takeFree { // the short Locker was granted the name last
				le, err := short.Acquire(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				le.Release(ctx)
			}
			le, err := long.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
			le, err = short.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			h, err := short.Holder(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if h.Remaining > 2*time.Second {
				t.Errorf("takeFree %v: a lease with a 2s TTL that took over a row freed by a 10min lease expires in %v", takeFree, h.Remaining)
			}
			le.Release(ctx)
		}
	})
}
