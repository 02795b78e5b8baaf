package optimistic_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb"
)

// Benchmarks. Run them with, for example:
//
//	go test -run '^$' -bench . -benchtime 3s ./optimistic/
//
// Every simulated replica has a pool (and a Locker) of its own, as replicas of a
// service do. Statements are counted as they are sent (testdb.OpenCounting).

// BenchmarkUncontended: Acquire+Release of one name by one Locker, interleaved
// operation by operation with the raw pair it is built from (a plain SELECT of the
// version, then the compare-and-swap UPDATE) on a row of the same table. x-raw is the
// lock's throughput as a fraction of the raw pair's.
func BenchmarkUncontended(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			var n atomic.Int64
			db := testdb.OpenCounting(b, d, &n)
			ctx := context.Background()
			l, err := optimistic.New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			name := testdb.Name(b)
			// The raw pair's row.
			rawKey := namekey.Key(testdb.Name(b, "raw"))
			if _, err := db.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO sqllock_optimistic (lock_key, name, expires_at) VALUES (?, ?, "+now(d)+")"),
				rawKey, []byte("raw")); err != nil {
				b.Fatal(err)
			}
			sel := testdb.Rebind(d, "SELECT version FROM sqllock_optimistic WHERE lock_key = ?")
			cas := testdb.Rebind(d, "UPDATE sqllock_optimistic SET version = ? WHERE lock_key = ? AND version = ?")
			var tRaw, tLock time.Duration
			var stmtsLock int64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				var v int64
				if err := db.QueryRowContext(ctx, sel, rawKey).Scan(&v); err != nil {
					b.Fatal(err)
				}
				if err := optimistic.Swap(ctx, db, cas, v+1, rawKey, v); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				before := n.Load()
				lease, err := l.Acquire(ctx, name)
				if err != nil {
					b.Fatal(err)
				}
				if err := lease.Release(ctx); err != nil {
					b.Fatal(err)
				}
				stmtsLock += n.Load() - before
				tRaw += t1.Sub(t0)
				tLock += time.Since(t1)
			}
			b.StopTimer()
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(float64(tLock.Nanoseconds())/float64(b.N), "lock-ns/op")
			b.ReportMetric(float64(tRaw.Nanoseconds())/float64(b.N), "raw-ns/op")
			b.ReportMetric(float64(tRaw)/float64(tLock), "x-raw")
			b.ReportMetric(float64(stmtsLock)/float64(b.N), "lock-stmts/op")
		})
	}
}

func now(d sqllock.Dialect) string {
	if d == sqllock.Postgres {
		return "clock_timestamp()"
	}
	return "UTC_TIMESTAMP(6)"
}

// BenchmarkIncrements: 1, 4 and 8 replicas (a pool each) increment one balance,
// b.N increments in all, with Retry (read, compare-and-swap, again on a conflict)
// and, beside it in the same run, with forupdate.WithLock (lock, read, write,
// commit). Reported per method: successful increments per second, conflicts per
// success (Retry) and statements per success.
func BenchmarkIncrements(b *testing.B) {
	for _, d := range testdb.Dialects {
		for _, replicas := range []int{1, 4, 8} {
			b.Run(fmt.Sprintf("%v/replicas=%d", d, replicas), func(b *testing.B) {
				benchIncrements(b, d, replicas)
			})
		}
	}
}

func benchIncrements(b *testing.B, d sqllock.Dialect, replicas int) {
	ctx := context.Background()
	var sent atomic.Int64
	pools := make([]*sql.DB, replicas)
	lockers := make([]*forupdate.Locker, replicas)
	for i := range pools {
		pools[i] = testdb.OpenCounting(b, d, &sent)
		l, err := forupdate.New(pools[i], d)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { l.Close() })
		lockers[i] = l
	}
	id := newAccount(b, pools[0], d)
	sel := testdb.Rebind(d, "SELECT balance, version FROM "+account+" WHERE id = ?")
	cas := testdb.Rebind(d, "UPDATE "+account+" SET balance = ?, version = ? WHERE id = ? AND version = ?")
	upd := testdb.Rebind(d, "UPDATE "+account+" SET balance = ? WHERE id = ?")
	lockName := testdb.Name(b, "increments")

	run := func(each func(i int) error) (time.Duration, int64) {
		var left atomic.Int64
		left.Store(int64(b.N))
		start, before := time.Now(), sent.Load()
		var wg sync.WaitGroup
		for i := 0; i < replicas; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for left.Add(-1) >= 0 {
					if err := each(i); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		return time.Since(start), sent.Load() - before
	}
	var conflicts atomic.Int64
	b.ResetTimer()
	tRetry, sRetry := run(func(i int) error {
		db := pools[i]
		return optimistic.Retry(ctx, func(ctx context.Context) error {
			var bal, ver int64
			if err := db.QueryRowContext(ctx, sel, id).Scan(&bal, &ver); err != nil {
				return err
			}
			err := optimistic.Swap(ctx, db, cas, bal+1, ver+1, id, ver)
			if errors.Is(err, optimistic.ErrConflict) {
				conflicts.Add(1)
			}
			return err
		}, optimistic.WithAttempts(1000), optimistic.WithBackoff(50*time.Microsecond, 5*time.Millisecond))
	})
	tLock, sLock := run(func(i int) error {
		return lockers[i].WithLock(ctx, lockName, func(ctx context.Context, tx *sql.Tx) error {
			var bal, ver int64
			if err := tx.QueryRowContext(ctx, sel, id).Scan(&bal, &ver); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, upd, bal+1, id)
			return err
		})
	})
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(n/tRetry.Seconds(), "retry-incr/s")
	b.ReportMetric(float64(conflicts.Load())/n, "retry-conflicts/incr")
	b.ReportMetric(float64(sRetry)/n, "retry-stmts/incr")
	b.ReportMetric(n/tLock.Seconds(), "forupdate-incr/s")
	b.ReportMetric(float64(sLock)/n, "forupdate-stmts/incr")
	b.ReportMetric(tLock.Seconds()/tRetry.Seconds(), "x-forupdate")
}
