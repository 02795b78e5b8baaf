//go:build ha

package ha_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb/ha"
)

// liveRows counts, on the primary, the rows of strategy s for names that hold their
// lock (live: expiry in the future on the database clock), and all its rows for them.
func liveRows(ctx context.Context, db *sql.DB, s string, names []string) (live, all int, err error) {
	const in = "IN (SELECT convert_to(unnest($1::text[]), 'UTF8'))"
	var q string
	switch s {
	case "uniqueindex":
		q = "SELECT count(*) FILTER (WHERE expires_at > clock_timestamp()), count(*) FROM sqllock_lease WHERE name " + in
	case "optimistic":
		q = "SELECT count(*) FILTER (WHERE expires_at > clock_timestamp()), count(*) FROM sqllock_optimistic WHERE name " + in
	case "fairqueue":
		q = `SELECT count(*) FILTER (WHERE t.expires_at > clock_timestamp()), count(*)
  FROM sqllock_ticket t JOIN sqllock_queue q ON q.lock_key = t.lock_key WHERE q.name ` + in
	default:
		return 0, 0, fmt.Errorf("no rows to count for %s", s)
	}
	err = db.QueryRowContext(ctx, q, names).Scan(&live, &all)
	return live, all, err
}

// pollUntil runs f every 100 ms until it reports done or ctx ends; it returns f's
// last values.
func pollUntil(ctx context.Context, f func() (done bool, err error)) error {
	for {
		done, err := f()
		if done {
			return err
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = ctx.Err()
			}
			return err
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestSyncStandbyDown: with the synchronous standby down, every commit on the
// primary waits for it. 20 acquisitions of each row strategy (10 Acquire and 10
// TryAcquire, on 20 names, at once) with a 2 s context must each return within 3 s
// with an error matching ErrNotAcquired, and must leave nothing behind: once the standby is back and has
// caught up, no lease of those names is live (a lease taken with a 3 min TTL, whose
// commit waited for the standby and went through later, would be), no backend waits
// in SyncRep, and once the Locker and its pool are closed no backend of their
// application_name is left. While the standby is down, the backends of the timed-out
// attempts must not go on waiting either (counted: waiting_down). One line per
// strategy:
//
//	SYNCDOWN strategy=... attempts=20 errors=... slowest=... leftover=... waiting=... waiting_down=... backends=...
func TestSyncStandbyDown(t *testing.T) {
	lab := ha.Start(t)
	admin := postgresPair(t, lab, "sync", false)
	const (
		attempts = 20
		timeout  = 2 * time.Second
		ttl      = 3 * time.Minute // a lease committed late must still be live when counted
	)
	stamp := time.Now().UnixNano()
	type run struct {
		strategy, app string
		db            *sql.DB
		l             sqllock.Locker
		names         []string
		errs          map[string]int
		slowest       time.Duration
		acquired      int
		waitingDown   int
	}
	var runs []*run
	for _, s := range rowStrategies {
		r := &run{strategy: s, app: fmt.Sprintf("ha-syncdown-%s-%d", s, stamp), errs: map[string]int{}}
		r.db = lab.Open(t, "pgx", withParam(t, lab.PrimaryDSN(), "application_name", r.app))
		r.l = mustLocker(t, s, r.db, sqllock.Postgres, lockerOpts{ttl: ttl})
		for i := range attempts {
			r.names = append(r.names, fmt.Sprintf("ha-syncdown/%d/%s/%d", stamp, s, i))
		}
		runs = append(runs, r)
	}
	countWaiting := func(ctx context.Context, app string) (int, error) {
		var n int
		q := "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
		args := []any{}
		if app != "" {
			q += " AND application_name = $1"
			args = append(args, app)
		}
		err := admin.QueryRowContext(ctx, q, args...).Scan(&n)
		return n, err
	}

	lab.StandbyStop(t)
	for _, r := range runs {
		var wg sync.WaitGroup
		var mu sync.Mutex
		for i, name := range r.names {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				t0 := time.Now()
				var lease sqllock.Lease
				var err error
				if i%2 == 0 {
					lease, err = r.l.Acquire(ctx, name)
				} else {
					lease, err = r.l.TryAcquire(ctx, name)
				}
				took := time.Since(t0)
				mu.Lock()
				r.slowest = max(r.slowest, took)
				if err == nil {
					r.acquired++
				} else {
					r.errs[errKind(err)]++
				}
				mu.Unlock()
				if took > timeout+time.Second {
					t.Errorf("%s: attempt %d returned after %v with a %v context: %v", r.strategy, i, took.Round(time.Millisecond), timeout, err)
				}
				if err != nil && !errors.Is(err, sqllock.ErrNotAcquired) {
					t.Errorf("%s: attempt %d: %v; want an error matching ErrNotAcquired", r.strategy, i, err)
				}
				if err == nil {
					t.Errorf("%s: attempt %d acquired %q (token %d) with the synchronous standby down", r.strategy, i, name, lease.Token())
					lease.Release(ctxFor(t, 10*time.Second))
				}
			})
		}
		wg.Wait()
		// The attempts are over: their backends should not be waiting for the standby.
		ctx := ctxFor(t, 5*time.Second)
		var n int
		pollUntil(ctx, func() (bool, error) {
			var err error
			n, err = countWaiting(ctx, r.app)
			return err == nil && n == 0, err
		})
		r.waitingDown = n
	}
	lab.StandbyStart(t)
	waitReplayed(t, admin)

	for _, r := range runs {
		ctx := ctxFor(t, 30*time.Second)
		// What the library may still do once the standby answers (delete the rows of
		// attempts of unknown outcome) gets 10 s.
		var live, all, waiting int
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := pollUntil(pctx, func() (bool, error) {
			var err error
			if live, all, err = liveRows(pctx, admin, r.strategy, r.names); err != nil {
				return false, err
			}
			if waiting, err = countWaiting(pctx, ""); err != nil {
				return false, err
			}
			return live == 0 && waiting == 0, nil
		})
		cancel()
		if err != nil && live == 0 && waiting == 0 {
			t.Fatalf("%s: counting rows and waiting backends: %v", r.strategy, err)
		}
		if c, ok := r.l.(closer); ok {
			c.Close()
		}
		r.db.Close()
		var backends int
		pctx, cancel = context.WithTimeout(ctx, 10*time.Second)
		pollUntil(pctx, func() (bool, error) {
			err := admin.QueryRowContext(pctx,
				"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND application_name = $1", r.app).Scan(&backends)
			return err == nil && backends == 0, err
		})
		cancel()
		var es []string
		for _, k := range slices.Sorted(maps.Keys(r.errs)) {
			es = append(es, fmt.Sprintf("%s:%d", k, r.errs[k]))
		}
		t.Logf("SYNCDOWN strategy=%s attempts=%d acquired=%d errors=%s slowest=%v leftover=%d rows=%d waiting=%d waiting_down=%d backends=%d",
			r.strategy, attempts, r.acquired, strings.Join(es, ","), r.slowest.Round(time.Millisecond), live, all, waiting, r.waitingDown, backends)
		if live != 0 {
			t.Errorf("%s: %d leases of the timed-out attempts are live once the standby is back: their commits went through later", r.strategy, live)
		}
		if waiting != 0 {
			t.Errorf("%s: %d backends still wait in SyncRep after the standby caught up", r.strategy, waiting)
		}
		if r.waitingDown != 0 {
			t.Errorf("%s: %d backends of the timed-out attempts went on waiting in SyncRep while the standby was down", r.strategy, r.waitingDown)
		}
		if backends != 0 {
			t.Errorf("%s: %d backends of application_name %s left after the Locker and its pool were closed", r.strategy, backends, r.app)
		}
	}
}
