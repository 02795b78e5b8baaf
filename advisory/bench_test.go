package advisory_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/testdb"
)

// Uncontended TryAcquire + Release, beside hand-written baselines on one pinned
// connection in the same run. Compare ns/op: ratio = baseline / advisory.
//
//	go test -run '^$' -bench . ./advisory/
func BenchmarkTryAcquireRelease(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			db := testdb.Open(b, d)
			name := testdb.Name(b)
			b.Run("raw-baseline", func(b *testing.B) { benchRaw(b, db, d, name, false) })
			if d == sqllock.MySQL {
				b.Run("raw-baseline-literal", func(b *testing.B) { benchRaw(b, db, d, name, true) })
				b.Run("raw-pool-literal", func(b *testing.B) { benchRawPool(b, db, "SELECT GET_LOCK('bench-raw-pool', 0), 1") })
			}
			b.Run("advisory-without-token", func(b *testing.B) {
				benchLocker(b, advisoryLocker(b, db, d, advisory.WithoutToken()), name)
			})
			b.Run("advisory-with-token", func(b *testing.B) {
				benchLocker(b, advisoryLocker(b, db, d), name)
			})
		})
	}
}

func advisoryLocker(b *testing.B, db *sql.DB, d sqllock.Dialect, opts ...advisory.Option) *advisory.Locker {
	l, err := advisory.New(db, d, opts...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	return l
}

func benchLocker(b *testing.B, l *advisory.Locker, name string) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		lease, err := l.TryAcquire(ctx, name)
		if err != nil {
			b.Fatal(err)
		}
		if err := lease.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// benchRaw is what one would write by hand: a pinned connection, the lock function
// and the unlock function. literal inlines the GET_LOCK name in the SQL text (one round
// trip per statement with go-sql-driver instead of prepare + execute).
func benchRaw(b *testing.B, db *sql.DB, d sqllock.Dialect, name string, literal bool) {
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	lockQ, unlockQ := "SELECT pg_try_advisory_lock($1)", "SELECT pg_advisory_unlock($1)"
	var arg any = int64(8327)
	var args []any
	if d == sqllock.MySQL {
		lockQ, unlockQ = "SELECT GET_LOCK(?, 0)", "SELECT RELEASE_LOCK(?)"
		arg = "bench-raw-" + name
		if len(arg.(string)) > 64 {
			arg = arg.(string)[:64]
		}
		if literal {
			lockQ = "SELECT GET_LOCK('bench-raw-literal', 0)"
			unlockQ = "SELECT RELEASE_LOCK('bench-raw-literal')"
		}
	}
	if !literal {
		args = []any{arg}
	}
	b.ReportAllocs()
	for b.Loop() {
		var ok bool
		if err := conn.QueryRowContext(ctx, lockQ, args...).Scan(&ok); err != nil || !ok {
			b.Fatalf("lock: %v %v", ok, err)
		}
		if err := conn.QueryRowContext(ctx, unlockQ, args...).Scan(&ok); err != nil || !ok {
			b.Fatalf("unlock: %v %v", ok, err)
		}
	}
}

// benchRawPool is benchRaw with literal SQL, pinning a pooled connection per
// acquisition as the Locker does: it measures the cost of the pinning alone.
func benchRawPool(b *testing.B, db *sql.DB, q string) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		conn, err := db.Conn(ctx)
		if err != nil {
			b.Fatal(err)
		}
		var ok bool
		if err := conn.QueryRowContext(ctx, q).Scan(&ok, new(int64)); err != nil || !ok {
			b.Fatalf("lock: %v %v", ok, err)
		}
		if err := conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK('bench-raw-pool')").Scan(&ok); err != nil || !ok {
			b.Fatalf("unlock: %v %v", ok, err)
		}
		conn.Close()
	}
}

// BenchmarkInterleaved alternates one baseline operation (hand-written, pinned
// connection) and one Locker operation, so that the load of a shared machine weighs
// on both alike, and reports both times and their ratio (baseline/advisory: 1 means
// as fast as the baseline; the target is at least 0.8 without the token).
//
// without-token-deadline runs both under a context with a deadline, as a caller's
// request context has: database/sql and the drivers then watch every statement's
// context, the baseline's included.
func BenchmarkInterleaved(b *testing.B) {
	for _, d := range testdb.Dialects {
		for _, kind := range []string{"without-token", "with-token", "without-token-deadline"} {
			tok := kind == "with-token"
			b.Run(d.String()+"/"+kind, func(b *testing.B) {
				ctx := context.Background()
				if kind == "without-token-deadline" {
					c, cancel := context.WithTimeout(ctx, time.Hour)
					defer cancel()
					ctx = c
				}
				db := testdb.Open(b, d)
				var opts []advisory.Option
				if !tok {
					opts = append(opts, advisory.WithoutToken())
				}
				l := advisoryLocker(b, db, d, opts...)
				name := testdb.Name(b)
				conn, err := db.Conn(ctx)
				if err != nil {
					b.Fatal(err)
				}
				defer conn.Close()
				// The fastest hand-written form of each dialect: a parameter on
				// PostgreSQL (pgx caches the prepared statement), a literal on MySQL
				// (go-sql-driver would prepare, execute and close a parameterised one).
				lockQ, unlockQ, args := "SELECT pg_try_advisory_lock($1)", "SELECT pg_advisory_unlock($1)", []any{int64(68168)}
				if d == sqllock.MySQL {
					lockQ, unlockQ, args = "SELECT GET_LOCK('bench-interleaved', 0)", "SELECT RELEASE_LOCK('bench-interleaved')", nil
				}
				var raw, adv time.Duration
				for b.Loop() {
					t0 := time.Now()
					var ok bool
					if err := conn.QueryRowContext(ctx, lockQ, args...).Scan(&ok); err != nil || !ok {
						b.Fatalf("lock: %v %v", ok, err)
					}
					if err := conn.QueryRowContext(ctx, unlockQ, args...).Scan(&ok); err != nil || !ok {
						b.Fatalf("unlock: %v %v", ok, err)
					}
					t1 := time.Now()
					lease, err := l.TryAcquire(ctx, name)
					if err != nil {
						b.Fatal(err)
					}
					if err := lease.Release(ctx); err != nil {
						b.Fatal(err)
					}
					t2 := time.Now()
					raw += t1.Sub(t0)
					adv += t2.Sub(t1)
				}
				b.ReportMetric(float64(raw.Nanoseconds())/float64(b.N), "baseline-ns/op")
				b.ReportMetric(float64(adv.Nanoseconds())/float64(b.N), "advisory-ns/op")
				b.ReportMetric(float64(raw)/float64(adv), "ratio")
			})
		}
	}
}
