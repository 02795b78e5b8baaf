package uniqueindex

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/testdb"
)

// Benchmarks. Run them with, for example:
//
//	go test -run '^$' -bench . -benchtime 5s ./uniqueindex/
//
// Each lock benchmark runs beside a hand-written raw INSERT/DELETE loop on the same
// table in the same run. Statements are counted as they are sent (a counting
// driver.Connector around the real one: the count pg_stat_statements would show, which
// is not installed on the test servers) and, on MySQL, also on the server as a delta
// of the global Questions counter (which includes other clients of the server).

// countingDB opens a pool on the test server of d whose statements are counted.
func countingDB(b *testing.B, d sqllock.Dialect) (*sql.DB, *atomic.Int64) {
	b.Helper()
	n := new(atomic.Int64)
	db := testdb.OpenCounting(b, d, n)
	db.SetMaxIdleConns(16)
	return db, n
}

// raw is the hand-written floor: one INSERT to take the lock, one DELETE to free it,
// expiry on the database clock, no token, no watchdog.
type raw struct {
	db          *sql.DB
	ins, del    string
	key, nameB  []byte
	owner       []byte
	dialectName sqllock.Dialect
}

func newRaw(db *sql.DB, d sqllock.Dialect, name string, owner string) *raw {
	r := &raw{db: db, key: namekey.Key(name), nameB: []byte(name), owner: []byte(owner), dialectName: d}
	if d == sqllock.Postgres {
		r.ins = `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at)
VALUES ($1, $2, $3, 1, 1, clock_timestamp(), clock_timestamp() + interval '30 seconds')`
		r.del = `DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2`
	} else {
		r.ins = `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at)
VALUES (?, ?, ?, 1, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)`
		r.del = `DELETE FROM sqllock_lease WHERE lock_key = ? AND owner = ?`
	}
	return r
}

func (r *raw) lock(ctx context.Context) (bool, error) {
	_, err := r.db.ExecContext(ctx, r.ins, r.key, r.nameB, r.owner)
	if sqlerr.Transient(err) {
		return false, nil
	}
	return err == nil, err
}

func (r *raw) unlock(ctx context.Context) error {
	_, err := r.db.ExecContext(ctx, r.del, r.key, r.owner)
	return err
}

// BenchmarkUncontended: one goroutine, Acquire+Release of one name, interleaved
// operation by operation with the raw INSERT+DELETE sent with db.ExecContext (raw) and
// with prepared statements (raw-prepared), so that load from other processes on the
// machine hits all three alike. ns/op is the lock's; x-raw and x-raw-prepared are the
// lock's throughput as a fraction of each floor's.
func BenchmarkUncontended(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			db, _ := countingDB(b, d)
			ctx := context.Background()
			r := newRaw(db, d, testdb.Name(b, "raw"), "raw")
			ins, err := db.PrepareContext(ctx, r.ins)
			if err != nil {
				b.Fatal(err)
			}
			defer ins.Close()
			del, err := db.PrepareContext(ctx, r.del)
			if err != nil {
				b.Fatal(err)
			}
			defer del.Close()
			l, err := New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			name := testdb.Name(b)
			var tRaw, tPrep, tLock time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if ok, err := r.lock(ctx); !ok || err != nil {
					b.Fatal(ok, err)
				}
				if err := r.unlock(ctx); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if _, err := ins.ExecContext(ctx, r.key, r.nameB, r.owner); err != nil {
					b.Fatal(err)
				}
				if _, err := del.ExecContext(ctx, r.key, r.owner); err != nil {
					b.Fatal(err)
				}
				t2 := time.Now()
				lease, err := l.Acquire(ctx, name)
				if err != nil {
					b.Fatal(err)
				}
				if err := lease.Release(ctx); err != nil {
					b.Fatal(err)
				}
				t3 := time.Now()
				tRaw += t1.Sub(t0)
				tPrep += t2.Sub(t1)
				tLock += t3.Sub(t2)
			}
			b.StopTimer()
			n := float64(b.N)
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(float64(tLock.Nanoseconds())/n, "lock-ns/op")
			b.ReportMetric(float64(tRaw.Nanoseconds())/n, "raw-ns/op")
			b.ReportMetric(float64(tPrep.Nanoseconds())/n, "raw-prepared-ns/op")
			b.ReportMetric(float64(tRaw)/float64(tLock), "x-raw")
			b.ReportMetric(float64(tPrep)/float64(tLock), "x-raw-prepared")
		})
	}
}

// BenchmarkContended: 8 goroutines take one name b.N times in all, each holding it
// for about 100µs. Reported: statements per acquisition (counted as sent, and on
// MySQL also from the server's Questions delta), and the smallest share of the
// acquisitions any goroutine got (%). The raw loop retries a refused INSERT after 1ms.
func BenchmarkContended(b *testing.B) {
	const workers, hold = 8, 100 * time.Microsecond
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			db, sent := countingDB(b, d)
			db.SetMaxOpenConns(workers + 2)
			admin := testdb.Open(b, d)
			run := func(b *testing.B, take func(ctx context.Context) (func(), error)) {
				ctx := context.Background()
				var remaining atomic.Int64
				remaining.Store(int64(b.N))
				per := make([]int64, workers)
				var errOnce sync.Once
				var firstErr error
				q0, s0 := testdb.Questions(b, admin), sent.Load()
				b.ResetTimer()
				var wg sync.WaitGroup
				for g := 0; g < workers; g++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for remaining.Add(-1) >= 0 {
							release, err := take(ctx)
							if err != nil {
								errOnce.Do(func() { firstErr = err })
								return
							}
							time.Sleep(hold)
							release()
							per[g]++
						}
					}()
				}
				wg.Wait()
				b.StopTimer()
				if firstErr != nil {
					b.Fatal(firstErr)
				}
				q1, s1 := testdb.Questions(b, admin), sent.Load()
				minShare := int64(b.N)
				for _, n := range per {
					minShare = min(minShare, n)
				}
				b.ReportMetric(float64(s1-s0)/float64(b.N), "stmts/acq")
				if d == sqllock.MySQL {
					// Minus the one SHOW STATUS of the measurement itself.
					b.ReportMetric(float64(q1-q0-1)/float64(b.N), "questions/acq")
				}
				b.ReportMetric(100*float64(minShare)/float64(b.N), "min-share-%")
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "acq/s")
			}
			b.Run("raw", func(b *testing.B) {
				name := testdb.Name(b)
				var owner atomic.Int64
				run(b, func(ctx context.Context) (func(), error) {
					r := newRaw(db, d, name, "raw"+time.Now().String()+string(rune('a'+owner.Add(1)%26)))
					for {
						ok, err := r.lock(ctx)
						if err != nil {
							return nil, err
						}
						if ok {
							return func() { r.unlock(ctx) }, nil
						}
						time.Sleep(time.Millisecond)
					}
				})
			})
			b.Run("lock", func(b *testing.B) {
				l, err := New(db, d)
				if err != nil {
					b.Fatal(err)
				}
				defer l.Close()
				name := testdb.Name(b)
				run(b, func(ctx context.Context) (func(), error) {
					lease, err := l.Acquire(ctx, name)
					if err != nil {
						return nil, err
					}
					return func() { lease.Release(ctx) }, nil
				})
			})
		})
	}
}
