package sqllock_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestPgxPool: every strategy works on a *sql.DB made from a *pgxpool.Pool with
// stdlib.OpenDBFromPool (README, pgx users):
//   - locks exclude each other across two Lockers on the pool, tokens increase;
//   - a waiter is woken by the release's NOTIFY through the LISTEN connection the
//     Locker opens from the pool's configuration (row strategies, whose poll
//     interval is set to 30 s here, so a missed notification fails the test);
//   - advisory's pinned session is given back to the pgxpool with the session
//     settings it changed (idle_session_timeout, tcp_user_timeout) reset.
func TestPgxPool(t *testing.T) {
	const d = sqllock.Postgres
	for _, s := range strategies {
		t.Run(s.name, func(t *testing.T) {
			testdb.CheckLeaks(t)
			ctx := testdb.Context(t, time.Minute)
			cfg, err := pgxpool.ParseConfig(testdb.DSN(t, d))
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 8
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			db := stdlib.OpenDBFromPool(pool)
			t.Cleanup(func() { db.Close() })
			// TTL 30 s, keep-alive 10 s; row strategies poll every 5 s at most, so a
			// wake-up within a second is the NOTIFY's.
			holder, waiter := s.timed(t, db, d, 30*time.Second, 10*time.Second), s.timed(t, db, d, 30*time.Second, 10*time.Second)
			name := testdb.Name(t, s.name)

			first, err := holder.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := waiter.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Fatalf("TryAcquire of a held lock = %v, want ErrNotAcquired", err)
			}
			type got struct {
				lease sqllock.Lease
				err   error
				at    time.Time
			}
			granted := make(chan got, 1)
			started := make(chan struct{})
			go func() {
				close(started)
				le, err := waiter.Acquire(ctx, name)
				granted <- got{le, err, time.Now()}
			}()
			<-started
			// The waiter waits: row strategies have their LISTEN session up (opened when
			// a waiter first has to wait), advisory and forupdate wait for the server's
			// lock.
			for waiting := false; !waiting; {
				if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
  WHERE datname = current_database() AND (query LIKE 'LISTEN sqllock%' OR wait_event_type = 'Lock'))`).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				if !waiting {
					time.Sleep(10 * time.Millisecond) // polling the server's view, not a guess
				}
			}
			released := time.Now()
			if err := first.Release(ctx); err != nil {
				t.Fatal(err)
			}
			g := <-granted
			if g.err != nil {
				t.Fatal(g.err)
			}
			woke := g.at.Sub(released)
			if woke > time.Second {
				t.Errorf("waiter granted %v after the release: not woken by a notification", woke)
			}
			if s.name != "advisory" || g.lease.Token() != 0 {
				if g.lease.Token() <= first.Token() {
					t.Errorf("token %d after %d", g.lease.Token(), first.Token())
				}
			}
			if err := g.lease.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if s.name == "advisory" {
				// Every connection back in the pgxpool has the server's defaults.
				conns := pool.AcquireAllIdle(ctx)
				for _, c := range conns {
					var idle, tcp string
					if err := c.QueryRow(ctx, "SELECT current_setting('idle_session_timeout'), current_setting('tcp_user_timeout')").Scan(&idle, &tcp); err != nil {
						t.Error(err)
					} else if idle != "0" || tcp != "0" {
						t.Errorf("a pooled connection kept idle_session_timeout=%s tcp_user_timeout=%s from a pinned session", idle, tcp)
					}
					c.Release()
				}
				t.Logf("checked %d idle pool connections", len(conns))
			}
			t.Logf("waiter granted %v after the release", woke.Round(time.Millisecond))
		})
	}
}
