package reaper

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

func TestMain(m *testing.M) {
	os.Exit(testdb.MainLeakFree(m))
}

func newLocker(t testing.TB, d sqllock.Dialect, opts ...uniqueindex.Option) *uniqueindex.Locker {
	l, err := uniqueindex.New(testdb.Open(t, d), d, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// signalWriter signals ch on every write (a log line).
type signalWriter chan struct{}

func (w signalWriter) Write(p []byte) (int, error) {
	select {
	case w <- struct{}{}:
	default:
	}
	return len(p), nil
}

func TestNewValidates(t *testing.T) {
	db := testdb.Open(t, sqllock.Postgres)
	for _, opts := range [][]Option{
		{WithBatchSize(0)}, {WithGrace(-time.Second)}, {WithSchedule("every now and then")}, {WithMaxBatches(-1)},
	} {
		if _, err := New(db, sqllock.Postgres, opts...); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("New with a bad option: %v, want ErrInvalidOption", err)
		}
	}
}

// TestTokensAcrossSweep: a dead holder's expired row is swept, and the next token is
// still greater than every earlier one.
func TestTokensAcrossSweep(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		l := newLocker(t, d)
		name := testdb.Name(t)
		var last int64
		for i := 0; i < 3; i++ {
			lease, err := l.Acquire(testdb.Context(t, 30*time.Second), name)
			if err != nil {
				t.Fatal(err)
			}
			if lease.Token() <= last {
				t.Fatalf("round %d: token %d after %d", i, lease.Token(), last)
			}
			last = lease.Token()
			// The holder "dies": acquired two hours ago by the database clock, its row
			// expired an hour ago. (On MySQL the reaper finds rows by the minute of
			// their acquisition.)
			q := "UPDATE sqllock_lease SET expires_at = acquired_at - INTERVAL 1 HOUR, acquired_at = acquired_at - INTERVAL 2 HOUR WHERE lock_key = ?"
			if d == sqllock.Postgres {
				q = "UPDATE sqllock_lease SET expires_at = acquired_at - interval '1 hour', acquired_at = acquired_at - interval '2 hours' WHERE lock_key = $1"
			}
			if _, err := admin.ExecContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name)); err != nil {
				t.Fatal(err)
			}
			r, err := New(admin, d, WithGrace(30*time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			rep, err := r.RunOnce(testdb.Context(t, time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			if rep.Deleted["sqllock_lease"] < 1 {
				t.Fatalf("sweep deleted nothing: %+v", rep)
			}
			// The swept lease finds out at its next renewal.
			lease.Release(testdb.Context(t, 30*time.Second))
		}
		t.Logf("tokens kept increasing across 3 sweeps (last %d)", last)
	})
}

// TestSweep100k: 100,000 expired rows are deleted in bounded batches by two reapers
// running at once, while acquirers keep working on other names; the longest
// Acquire+Release during the sweep is reported.
func TestSweep100k(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const rows, batch = 100000, 1000
		admin := testdb.Open(t, d)
		prefix := testdb.Name(t, "dead") + "/"
		q := `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at)
SELECT UNHEX(SHA2(CONCAT(?, x), 256)), CONCAT(?, x), 0x00, 1, 1, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR
FROM (WITH RECURSIVE dg(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM dg WHERE n < 9)
      SELECT a.n + 10*b.n + 100*c.n + 1000*e.n + 10000*f.n AS x FROM dg a, dg b, dg c, dg e, dg f) t`
		args := []any{prefix, prefix}
		if d == sqllock.Postgres {
			q = `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at)
SELECT sha256(convert_to($1 || g, 'UTF8')), convert_to($1 || g, 'UTF8'), '\x00'::bytea, 1, 1,
       clock_timestamp() - interval '2 hours', clock_timestamp() - interval '1 hour'
FROM generate_series(0, 99999) g`
			args = []any{prefix}
		}
		start := time.Now()
		res, err := admin.ExecContext(testdb.Context(t, 2*time.Minute), q, args...)
		if err != nil {
			t.Fatal(err)
		}
		if n, _ := res.RowsAffected(); n != rows {
			t.Fatalf("inserted %d rows", n)
		}
		t.Logf("inserted %d expired rows in %v", rows, time.Since(start).Round(time.Millisecond))

		// Acquirers on other names, timing every Acquire+Release.
		l := newLocker(t, d)
		stop := make(chan struct{})
		var maxStall, sum atomic.Int64
		var count atomic.Int64
		var wg sync.WaitGroup
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				name := testdb.Name(t, "live")
				for {
					select {
					case <-stop:
						return
					default:
					}
					t0 := time.Now()
					lease, err := l.Acquire(testdb.Context(t, time.Minute), name)
					if err != nil {
						t.Error(err)
						return
					}
					if err := lease.Release(testdb.Context(t, time.Minute)); err != nil {
						t.Error(err)
						return
					}
					el := int64(time.Since(t0))
					sum.Add(el)
					count.Add(1)
					for {
						m := maxStall.Load()
						if el <= m || maxStall.CompareAndSwap(m, el) {
							break
						}
					}
				}
			}()
		}
		// Reference without a sweep: the same acquirers for one second.
		maxStall.Store(0)
		sum.Store(0)
		count.Store(0)
		time.Sleep(time.Second) // a measurement window, not synchronisation
		if n := count.Load(); n > 0 {
			t.Logf("before the sweep: %d Acquire+Release in 1s, mean %v, longest %v", n,
				time.Duration(sum.Load()/n).Round(time.Microsecond), time.Duration(maxStall.Load()).Round(time.Microsecond))
		}
		maxStall.Store(0)
		sum.Store(0)
		count.Store(0)

		var reps [2]Report
		var errs [2]error
		start = time.Now()
		var rw sync.WaitGroup
		for i := range reps {
			r, err := New(testdb.Open(t, d), d, WithGrace(30*time.Minute), WithBatchSize(batch), WithMaxBatches(1000))
			if err != nil {
				t.Fatal(err)
			}
			rw.Add(1)
			go func() {
				defer rw.Done()
				reps[i], errs[i] = r.RunOnce(testdb.Context(t, 5*time.Minute))
			}()
		}
		rw.Wait()
		took := time.Since(start)
		close(stop)
		wg.Wait()
		total, batches := 0, 0
		for i := range reps {
			if errs[i] != nil {
				t.Errorf("reaper %d: %v", i, errs[i])
			}
			total += reps[i].Deleted["sqllock_lease"]
			batches += reps[i].Batches
		}
		if total < rows {
			t.Errorf("deleted %d rows, want at least %d", total, rows)
		}
		var left int
		cq := "SELECT count(*) FROM sqllock_lease WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL 30 MINUTE"
		if d == sqllock.Postgres {
			cq = "SELECT count(*) FROM sqllock_lease WHERE expires_at < clock_timestamp() - interval '30 minutes'"
		}
		if err := admin.QueryRowContext(testdb.Context(t, time.Minute), cq).Scan(&left); err != nil || left != 0 {
			t.Errorf("%d expired rows left (%v)", left, err)
		}
		n := count.Load()
		if n == 0 {
			t.Fatal("no acquisition completed during the sweep")
		}
		t.Logf("2 reapers deleted %d rows in %d batches of <= %d in %v (reaper A %d rows/%d batches, B %d/%d; "+
			"%d conflicts retried); %d Acquire+Release on other names meanwhile: mean %v, longest %v",
			total, batches, batch, took.Round(time.Millisecond),
			reps[0].Deleted["sqllock_lease"], reps[0].Batches, reps[1].Deleted["sqllock_lease"], reps[1].Batches,
			reps[0].Conflicts+reps[1].Conflicts,
			n, time.Duration(sum.Load()/n).Round(time.Microsecond), time.Duration(maxStall.Load()).Round(time.Microsecond))
	})
}

// TestStartStop: the cron schedule runs the sweep, and Stop ends it without leaks.
func TestStartStop(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		ran := make(chan struct{}, 1)
		logger := slog.New(slog.NewTextHandler(signalWriter(ran), nil))
		r, err := New(testdb.Open(t, d), d, WithSchedule("@every 1s"), WithGrace(30*time.Minute), WithLogger(logger))
		if err != nil {
			t.Fatal(err)
		}
		r.Start()
		r.Start()
		select {
		case <-ran: // the schedule ran a sweep and logged it
		case <-time.After(10 * time.Second):
			t.Fatal("no scheduled run within 10s")
		}
		if err := r.Stop(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
		if err := r.Stop(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
	})
}

// fakeSweeper returns the results of script in turn, then (0, false, nil).
type fakeSweeper struct {
	script []fakeBatch
	calls  int
}

type fakeBatch struct {
	n    int
	more bool
	err  error
}

func (f *fakeSweeper) Name() string { return "fake" }

func (f *fakeSweeper) SweepBatch(ctx context.Context, limit int) (int, bool, error) {
	f.calls++
	if len(f.script) == 0 {
		return 0, false, nil
	}
	b := f.script[0]
	f.script = f.script[1:]
	return b.n, b.more, b.err
}

// TestConflictsRetried: a deadlock or lock wait timeout in a batch is counted and the
// batch retried; repeated conflicts end the Sweeper's turn without an error (the
// lease table's sweeper and the other sweepers still run); other errors are returned.
func TestConflictsRetried(t *testing.T) {
	deadlock := &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock"}
	timeout := &pgconn.PgError{Code: "55P03", Message: "canceling statement due to lock timeout"}
	db := testdb.Open(t, sqllock.Postgres)
	run := func(t *testing.T, s ...Sweeper) (Report, error) {
		t.Helper()
		r, err := New(db, sqllock.Postgres, WithGrace(30*time.Minute), WithBatchSize(10), WithSweepers(s...))
		if err != nil {
			t.Fatal(err)
		}
		return r.RunOnce(testdb.Context(t, time.Minute))
	}

	f := &fakeSweeper{script: []fakeBatch{{10, true, nil}, {0, false, deadlock}, {10, true, nil}, {0, false, timeout}, {3, false, nil}}}
	rep, err := run(t, f)
	if err != nil || rep.Deleted["fake"] != 23 || rep.Conflicts != 2 || f.calls != 5 {
		t.Errorf("2 conflicts among 3 batches: %+v, %d calls, %v; want 23 deleted, 2 conflicts, 5 calls, no error", rep, f.calls, err)
	}

	var script []fakeBatch
	for i := 0; i < 10; i++ {
		script = append(script, fakeBatch{0, false, deadlock})
	}
	f, g := &fakeSweeper{script: script}, &fakeSweeper{script: []fakeBatch{{2, false, nil}}}
	rep, err = run(t, f, g)
	if err != nil || rep.Conflicts != maxConflicts || f.calls != maxConflicts || g.calls != 1 {
		t.Errorf("endless deadlocks: %+v, %d and %d calls, %v; want %d conflicts, then the next sweeper, no error",
			rep, f.calls, g.calls, err, maxConflicts)
	}

	boom := errors.New("boom")
	f, g = &fakeSweeper{script: []fakeBatch{{1, true, boom}}}, &fakeSweeper{script: []fakeBatch{{2, false, nil}}}
	rep, err = run(t, f, g)
	if !errors.Is(err, boom) || f.calls != 1 || g.calls != 1 || rep.Deleted["fake"] != 3 {
		t.Errorf("other error: %+v, %d and %d calls, %v; want boom returned after the next sweeper ran", rep, f.calls, g.calls, err)
	}
}

// TestReaperWithout0007 (MySQL): on a database whose schema predates migration
// mysql/0007 (the index on acquired_min the lease sweep reads through), the reaper
// fails with an error matching sqllock.ErrNotMigrated, as the README's Upgrading
// section says; with the index it sweeps.
func TestReaperWithout0007(t *testing.T) {
	const d = sqllock.MySQL
	ctx := testdb.Context(t, time.Minute)
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	r, err := New(db, d)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.RunOnce(ctx); err != nil {
		t.Fatalf("reaper on a migrated database: %v", err)
	}
	// 0007's down migration, by hand: the schema of version 6.
	if _, err := db.ExecContext(ctx, `ALTER TABLE sqllock_lease ADD KEY sqllock_lease_expires_at (expires_at),
  DROP KEY sqllock_lease_acquired_min, DROP COLUMN acquired_min`); err != nil {
		t.Fatal(err)
	}
	_, err = r.RunOnce(ctx)
	if !errors.Is(err, sqllock.ErrNotMigrated) || !strings.Contains(err.Error(), "sqllock_lease_acquired_min") {
		t.Fatalf("reaper without 0007's index: %v, want an error matching ErrNotMigrated that names the index", err)
	}
}
