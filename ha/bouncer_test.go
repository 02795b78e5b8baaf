//go:build ha

package ha_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb/ha"
)

// stmtCacheError reports whether err is one of the errors pgx's statement cache
// meets behind a transaction-pooling proxy (42P05 prepared statement already exists,
// 26000 prepared statement does not exist), and whether its *pgconn.PgError is still
// reachable with errors.As.
func stmtCacheError(err error) (is, asPgError bool) {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && (pe.Code == "42P05" || pe.Code == "26000") {
		return true, true
	}
	msg := err.Error()
	return strings.Contains(msg, "42P05") || strings.Contains(msg, "26000"), false
}

// TestBouncerHint: uniqueindex through pgbouncer in transaction mode with pgx's
// default statement cache (the DSN without default_query_exec_mode) meets 42P05 and
// 26000: a prepared statement lives on one server connection, and the next
// transaction runs on another. Each such error of an acquisition must say what to
// do (mention default_query_exec_mode) and keep its cause (errors.As finds the
// *pgconn.PgError). Two pools, four goroutines each, a name per acquisition.
func TestBouncerHint(t *testing.T) {
	lab := ha.Start(t)
	postgresPair(t, lab, "sync", false)
	dsn := withParam(t, lab.BouncerDSN("transaction"), "default_query_exec_mode", "")
	const (
		pools, workers, rounds = 2, 4, 20
	)
	var mu sync.Mutex
	var attempts, ok, cacheErrs, hinted, other int
	var shown []string
	stamp := time.Now().UnixNano()
	var wg sync.WaitGroup
	for p := range pools {
		db := lab.Open(t, "pgx", dsn)
		l := mustLocker(t, "uniqueindex", db, sqllock.Postgres, lockerOpts{})
		for w := range workers {
			wg.Go(func() {
				for i := range rounds {
					// A name per round: a lease whose release failed stays held until its TTL.
					name := fmt.Sprintf("ha-bouncer-hint/%d/%d/%d/%d", stamp, p, w, i)
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					var lease sqllock.Lease
					var err error
					if i%2 == 0 {
						lease, err = l.Acquire(ctx, name)
					} else {
						lease, err = l.TryAcquire(ctx, name)
					}
					cancel()
					if err == nil {
						lease.Release(ctxFor(t, 10*time.Second)) // its errors are not the subject here
					}
					is, as := false, false
					if err != nil {
						is, as = stmtCacheError(err)
					}
					mu.Lock()
					attempts++
					switch {
					case err == nil:
						ok++
					case is:
						cacheErrs++
						if strings.Contains(err.Error(), "default_query_exec_mode") {
							hinted++
						} else if len(shown) < 3 {
							shown = append(shown, err.Error())
						}
						if !as {
							t.Errorf("statement cache error without its *pgconn.PgError (errors.As): %v", err)
						}
					default:
						other++
						if len(shown) < 6 {
							shown = append(shown, "other: "+err.Error())
						}
					}
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	t.Logf("BOUNCERHINT attempts=%d ok=%d stmtcache_errors=%d with_hint=%d other_errors=%d", attempts, ok, cacheErrs, hinted, other)
	for _, s := range shown {
		t.Logf("  %s", s)
	}
	if cacheErrs == 0 {
		t.Errorf("no 42P05/26000 error in %d acquisitions through pgbouncer in transaction mode with pgx's statement cache: "+
			"the test no longer reproduces what the hint is for (%d other errors)", attempts, other)
	}
	if hinted != cacheErrs {
		t.Errorf("%d of %d statement cache errors do not mention default_query_exec_mode", cacheErrs-hinted, cacheErrs)
	}
}
