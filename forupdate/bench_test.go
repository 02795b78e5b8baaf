package forupdate_test

import (
	"context"
	"crypto/sha256"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/testdb"
)

// baselineNs holds the raw baseline's ns/op of each dialect, measured first in the
// same run, for the ratio reported by the Locker benchmark.
var baselineNs, baselineWriteNs sync.Map

// BenchmarkUncontended compares one Locker acquisition and release (Lock + Release,
// i.e. BEGIN, the locking statement that also draws the token, COMMIT; WithoutToken:
// a plain locking read)
// with a hand-written raw BEGIN / SELECT ... FOR UPDATE / COMMIT on the same row, in
// the same run. x-raw-throughput is the Locker's throughput as a fraction of the raw
// one.
func BenchmarkUncontended(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			var n atomic.Int64
			db := testdb.OpenCounting(b, d, &n)
			l, err := forupdate.New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { l.Close() })
			name := testdb.Name(b)
			ctx := context.Background()
			lease, err := l.Lock(ctx, name) // creates the row
			if err != nil {
				b.Fatal(err)
			}
			lease.Release(ctx)
			key := sqllockKey(name)
			raw := "SELECT token FROM sqllock_rowlock WHERE lock_key = ? FOR UPDATE"
			if d == sqllock.Postgres {
				raw = "SELECT token FROM sqllock_rowlock WHERE lock_key = $1 FOR UPDATE"
			}
			b.Run("raw", func(b *testing.B) {
				n.Store(0)
				for i := 0; i < b.N; i++ {
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						b.Fatal(err)
					}
					var tok int64
					if err := tx.QueryRowContext(ctx, raw, key).Scan(&tok); err != nil {
						b.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n.Load())/float64(b.N), "stmts/op")
				baselineNs.Store(d, float64(b.Elapsed().Nanoseconds())/float64(b.N))
			})
			// rawWrite adds the row write a fencing token needs (one UPDATE, committed
			// and flushed): the floor for any lock whose token survives a rollback.
			upd := "UPDATE sqllock_rowlock SET acquired_at = UTC_TIMESTAMP(6) WHERE lock_key = ?"
			if d == sqllock.Postgres {
				upd = "UPDATE sqllock_rowlock SET acquired_at = clock_timestamp() WHERE lock_key = $1"
			}
			b.Run("raw-with-write", func(b *testing.B) {
				n.Store(0)
				for i := 0; i < b.N; i++ {
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						b.Fatal(err)
					}
					var tok int64
					if err := tx.QueryRowContext(ctx, raw, key).Scan(&tok); err != nil {
						b.Fatal(err)
					}
					if _, err := tx.ExecContext(ctx, upd, key); err != nil {
						b.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n.Load())/float64(b.N), "stmts/op")
				baselineWriteNs.Store(d, float64(b.Elapsed().Nanoseconds())/float64(b.N))
			})
			noToken, err := forupdate.New(db, d, forupdate.WithoutToken())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { noToken.Close() })
			for _, c := range []struct {
				name string
				l    *forupdate.Locker
			}{{"locker", l}, {"locker-without-token", noToken}} {
				b.Run(c.name, func(b *testing.B) {
					n.Store(0)
					for i := 0; i < b.N; i++ {
						lease, err := c.l.Lock(ctx, name)
						if err != nil {
							b.Fatal(err)
						}
						if err := lease.Release(ctx); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportMetric(float64(n.Load())/float64(b.N), "stmts/op")
					per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
					if base, ok := baselineNs.Load(d); ok {
						b.ReportMetric(base.(float64)/per, "x-raw-throughput")
					}
					if base, ok := baselineWriteNs.Load(d); ok {
						b.ReportMetric(base.(float64)/per, "x-raw-write-throughput")
					}
				})
			}
		})
	}
}

// BenchmarkContended: 8 goroutines take one name in turn. stmts/op counts what the
// clients sent per acquisition (wrapping driver); on MySQL server-questions/op is the
// server's Questions delta per acquisition (including other clients of the server).
func BenchmarkContended(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			var n atomic.Int64
			db := testdb.OpenCounting(b, d, &n)
			admin := testdb.Open(b, d)
			l, err := forupdate.New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { l.Close() })
			name := testdb.Name(b)
			ctx := context.Background()
			lease, err := l.Lock(ctx, name)
			if err != nil {
				b.Fatal(err)
			}
			lease.Release(ctx)
			const goroutines = 8
			var q0 int64
			if d == sqllock.MySQL {
				q0 = testdb.Questions(b, admin)
			}
			n.Store(0)
			b.ResetTimer()
			var remaining atomic.Int64
			remaining.Store(int64(b.N))
			var wg sync.WaitGroup
			for g := 0; g < goroutines; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for remaining.Add(-1) >= 0 {
						lease, err := l.Lock(ctx, name)
						if err != nil {
							b.Error(err)
							return
						}
						if err := lease.Release(ctx); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(n.Load())/float64(b.N), "stmts/op")
			if d == sqllock.MySQL {
				// minus the SHOW STATUS that reads the counter
				b.ReportMetric(float64(testdb.Questions(b, admin)-q0-1)/float64(b.N), "server-questions/op")
			}
		})
	}
}

func sqllockKey(name string) []byte {
	k := sha256.Sum256([]byte(name))
	return k[:]
}
