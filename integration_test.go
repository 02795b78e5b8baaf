package sqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/reaper"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// The integration suites: every strategy on PostgreSQL and MySQL/MariaDB, started
// with testcontainers (or the DSN variables; see package testdb). Each strategy's
// package runs the conformance suite (locktest) and its fault tests; this file runs
// what a user does with all of them together: migrate a fresh schema, take locks
// from several replicas through sqllock.Do, and migrate down and up again.

// TestMain starts no server itself: testdb starts one container per dialect on first
// use (or uses the DSN variables) and Main terminates them after the run.
func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// strategy builds a Locker of one strategy on a pool: with the defaults (new), or
// with a given TTL and keep-alive interval (timed; row strategies also poll at half
// the keep-alive interval).
type strategy struct {
	name  string
	new   func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker
	timed func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, keepalive time.Duration) sqllock.Locker
}

// newShort: a Locker with short timings (keep-alive every 200ms).
func (s strategy) newShort(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
	ttl := 2 * time.Second
	if s.name == "forupdate" {
		ttl = 3 * time.Second
	}
	return s.timed(t, db, d, ttl, 200*time.Millisecond)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// closing registers c's Close and returns l.
func closing(t testing.TB, l sqllock.Locker, c interface{ Close() error }) sqllock.Locker {
	t.Cleanup(func() { c.Close() })
	return l
}

var strategies = []strategy{
	{"uniqueindex", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := uniqueindex.New(db, d, uniqueindex.WithTTL(10*time.Second))
		must(t, err)
		return closing(t, l, l)
	}, func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, ka time.Duration) sqllock.Locker {
		l, err := uniqueindex.New(db, d, uniqueindex.WithTTL(ttl), uniqueindex.WithKeepalive(ka), uniqueindex.WithPollInterval(ka/2))
		must(t, err)
		return closing(t, l, l)
	}},
	{"forupdate", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := forupdate.New(db, d)
		must(t, err)
		return closing(t, l, l)
	}, func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, ka time.Duration) sqllock.Locker {
		l, err := forupdate.New(db, d, forupdate.WithTTL(ttl), forupdate.WithKeepalive(ka))
		must(t, err)
		return closing(t, l, l)
	}},
	{"advisory", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := advisory.New(db, d)
		must(t, err)
		return closing(t, l, l)
	}, func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, ka time.Duration) sqllock.Locker {
		l, err := advisory.New(db, d, advisory.WithTTL(ttl), advisory.WithKeepalive(ka))
		must(t, err)
		return closing(t, l, l)
	}},
	{"optimistic", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := optimistic.New(db, d, optimistic.WithTTL(10*time.Second))
		must(t, err)
		return closing(t, l, l)
	}, func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, ka time.Duration) sqllock.Locker {
		l, err := optimistic.New(db, d, optimistic.WithTTL(ttl), optimistic.WithKeepalive(ka), optimistic.WithPollInterval(ka/2))
		must(t, err)
		return closing(t, l, l)
	}},
	{"fairqueue", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := fairqueue.New(db, d, fairqueue.WithTTL(10*time.Second))
		must(t, err)
		return closing(t, l, l)
	}, func(t testing.TB, db *sql.DB, d sqllock.Dialect, ttl, ka time.Duration) sqllock.Locker {
		l, err := fairqueue.New(db, d, fairqueue.WithTTL(ttl), fairqueue.WithKeepalive(ka), fairqueue.WithPollInterval(ka/2))
		must(t, err)
		return closing(t, l, l)
	}},
}

// TestFreshSchema: in a new, empty schema (PostgreSQL) or database (MySQL), Up
// creates what every strategy needs; Down removes it, so the strategies fail with a
// clear error; Up again brings them back, with tokens counted from the start.
func TestFreshSchema(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.OpenIsolated(t, d)
		ctx := testdb.Context(t, 2*time.Minute)
		use := func(s strategy, wantToken int64) error {
			l := s.new(t, db, d)
			lease, err := l.Acquire(ctx, "fresh/"+s.name)
			if err != nil {
				return err
			}
			defer lease.Release(ctx)
			if wantToken != 0 && lease.Token() != wantToken {
				t.Errorf("%s: first token in a fresh schema = %d, want %d", s.name, lease.Token(), wantToken)
			}
			return nil
		}
		for round := 0; round < 2; round++ {
			if err := migrations.Up(ctx, db, d); err != nil {
				t.Fatalf("round %d: Up: %v", round, err)
			}
			for _, s := range strategies {
				if err := use(s, 0); err != nil {
					t.Fatalf("round %d: %s after Up: %v", round, s.name, err)
				}
			}
			if err := migrations.Down(ctx, db, d); err != nil {
				t.Fatalf("round %d: Down: %v", round, err)
			}
			// Every strategy needs a table (advisory for its fencing token), and says
			// to run the migrations.
			for _, s := range strategies {
				if err := use(s, 0); err == nil {
					t.Errorf("round %d: %s works after Down: the migrations do not own its tables", round, s.name)
				} else if !errors.Is(err, sqllock.ErrNotMigrated) {
					t.Errorf("round %d: %s on an unmigrated database: %v, want an error matching ErrNotMigrated", round, s.name, err)
				}
			}
			// So does the reaper.
			r, err := reaper.New(db, d)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.RunOnce(ctx); !errors.Is(err, sqllock.ErrNotMigrated) {
				t.Errorf("round %d: reaper on an unmigrated database: %v, want an error matching ErrNotMigrated", round, err)
			}
		}
	})
}

// TestReplicas: three replicas of a service (three pools, a Locker each) run a job
// through sqllock.Do with every strategy. The job is a deliberately non-atomic
// read-modify-write of a row; the lock must make every run count, and each run's
// token must exceed the previous run's.
func TestReplicas(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, s := range strategies {
			t.Run(s.name, func(t *testing.T) {
				// Registered first, so it runs after the pools and Lockers are closed.
				testdb.CheckLeaks(t)
				ctx := testdb.Context(t, 2*time.Minute)
				admin := testdb.Open(t, d)
				table := fmt.Sprintf("sqllock_it_jobs_%s", s.name)
				ph := "?"
				if d == sqllock.Postgres {
					ph = "$1"
				}
				if _, err := admin.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+table+" (id int PRIMARY KEY, runs int NOT NULL, last_token bigint NOT NULL)"); err != nil {
					t.Fatal(err)
				}
				admin.ExecContext(ctx, "DELETE FROM "+table)
				if _, err := admin.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1, 0, 0)"); err != nil {
					t.Fatal(err)
				}
				name := testdb.Name(t, "nightly-report")
				const replicas, runsEach = 3, 15
				var wg sync.WaitGroup
				errs := make(chan error, replicas*runsEach)
				for r := 0; r < replicas; r++ {
					db := testdb.Open(t, d)
					locker := s.new(t, db, d)
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := 0; i < runsEach; i++ {
							var lease sqllock.Lease
							err := sqllock.Do(ctx, tokenSpy{locker, &lease}, name, func(ctx context.Context) error {
								var runs int
								var last int64
								if err := db.QueryRowContext(ctx, "SELECT runs, last_token FROM "+table+" WHERE id = 1").Scan(&runs, &last); err != nil {
									return err
								}
								if lease.Token() <= last {
									return fmt.Errorf("token %d not above the previous run's %d", lease.Token(), last)
								}
								time.Sleep(time.Millisecond) // widen the race on purpose
								q := fmt.Sprintf("UPDATE %s SET runs = %d, last_token = %s WHERE id = 1", table, runs+1, ph)
								_, err := db.ExecContext(ctx, q, lease.Token())
								return err
							})
							if err != nil {
								errs <- err
							}
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Error(err)
				}
				var runs int
				if err := admin.QueryRowContext(ctx, "SELECT runs FROM "+table+" WHERE id = 1").Scan(&runs); err != nil {
					t.Fatal(err)
				}
				if runs != replicas*runsEach {
					t.Errorf("%d runs counted, want %d: two replicas ran the job at once", runs, replicas*runsEach)
				}
			})
		}
	})
}

// tokenSpy passes Acquire through and records the lease for the job to read.
type tokenSpy struct {
	sqllock.Locker
	lease *sqllock.Lease
}

func (s tokenSpy) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	l, err := s.Locker.Acquire(ctx, name, opts...)
	*s.lease = l
	return l, err
}

// TestStrategiesAreIndependent: the strategies are different lock families. The same
// name held with one strategy is free with another (documented in the README): a
// name must be locked with one strategy everywhere.
func TestStrategiesAreIndependent(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		name := testdb.Name(t)
		var held []sqllock.Lease
		for _, s := range strategies {
			lease, err := s.new(t, testdb.Open(t, d), d).TryAcquire(ctx, name)
			if err != nil {
				t.Fatalf("%s: %v while other strategies hold the same name", s.name, err)
			}
			held = append(held, lease)
		}
		for _, l := range held {
			if err := l.Release(ctx); err != nil && !errors.Is(err, sqllock.ErrNotHeld) {
				t.Error(err)
			}
		}
	})
}

// privileges are the grants each strategy needs at run time, once an administrator
// has applied the migrations. The README's "Privileges" section lists the same.
var privileges = map[string]map[sqllock.Dialect][]string{
	"uniqueindex": {
		sqllock.Postgres: {"SELECT, INSERT, UPDATE, DELETE ON sqllock_lease", "SELECT, INSERT, UPDATE ON sqllock_fence"},
		// MySQL keeps lease rows (released in place) and only reads the counters.
		sqllock.MySQL: {"SELECT, INSERT, UPDATE ON sqllock_lease", "SELECT ON sqllock_fence"},
	},
	"forupdate": {
		sqllock.Postgres: {"SELECT, INSERT, UPDATE ON sqllock_rowlock", "USAGE ON SEQUENCE sqllock_rowlock_token_seq",
			"SELECT, INSERT ON sqllock_epoch", "USAGE ON SEQUENCE sqllock_token_seq"},
		sqllock.MySQL: {"SELECT, INSERT, UPDATE, DELETE ON sqllock_rowlock",
			"SELECT, INSERT ON sqllock_epoch", "SELECT, INSERT, UPDATE ON sqllock_runs"},
	},
	"advisory": {
		sqllock.Postgres: {"SELECT, INSERT ON sqllock_epoch", "USAGE ON SEQUENCE sqllock_token_seq"},
		sqllock.MySQL:    {"SELECT, INSERT ON sqllock_epoch", "SELECT, INSERT ON sqllock_runs"},
	},
	"optimistic": {
		sqllock.Postgres: {"SELECT, INSERT, UPDATE ON sqllock_optimistic", "SELECT ON sqllock_fence"},
		sqllock.MySQL:    {"SELECT, INSERT, UPDATE ON sqllock_optimistic", "SELECT ON sqllock_fence"},
	},
	"fairqueue": {
		sqllock.Postgres: {"SELECT, INSERT, UPDATE ON sqllock_queue", "SELECT, INSERT, UPDATE, DELETE ON sqllock_ticket"},
		sqllock.MySQL:    {"SELECT, INSERT, UPDATE ON sqllock_queue", "SELECT, INSERT, UPDATE, DELETE ON sqllock_ticket"},
	},
}

// migrationsGrant lets a user check that the schema is current (migrations.Up and
// Version at start-up) without the right to change it.
const migrationsGrant = "SELECT ON sqllock_schema_migrations"

// TestPrivileges: each strategy works for a user that has exactly the documented
// grants and nothing else: migrations.Up on a current schema succeeds, and the lock
// is acquired, contended, kept alive, checked and released.
func TestPrivileges(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, s := range strategies {
			t.Run(s.name, func(t *testing.T) {
				testdb.CheckLeaks(t)
				ctx := testdb.Context(t, 2*time.Minute)
				grants := append([]string{migrationsGrant}, privileges[s.name][d]...)
				dbA, dbB := testdb.OpenAs(t, d, grants...), testdb.OpenAs(t, d, grants...)
				if err := migrations.Up(ctx, dbA, d); err != nil {
					t.Fatalf("migrations.Up on a current schema, as a user without CREATE: %v", err)
				}
				if v, dirty, err := migrations.Version(ctx, dbA, d); err != nil || v == 0 || dirty {
					t.Fatalf("migrations.Version: %d, %v, %v", v, dirty, err)
				}
				a, b := s.newShort(t, dbA, d), s.newShort(t, dbB, d)
				name := testdb.Name(t)
				first, err := a.Acquire(ctx, name)
				if err != nil {
					t.Fatalf("Acquire: %v", err)
				}
				if _, err := b.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
					t.Fatalf("TryAcquire of a held lock: %v, want ErrNotAcquired", err)
				}
				// A waiter with a deadline, and one cancelled: interrupts on the server.
				wctx, wcancel := context.WithTimeout(ctx, 300*time.Millisecond)
				_, err = b.Acquire(wctx, name)
				wcancel()
				if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("Acquire past its deadline: %v", err)
				}
				// Keep-alives run (every 200ms) for a while.
				select {
				case <-first.Done():
					t.Fatalf("lease lost while held: %v", first.Err())
				case <-time.After(time.Second):
				}
				if c, ok := first.(interface {
					Check(context.Context, *sql.Tx) error
				}); ok {
					tx, err := dbA.BeginTx(ctx, nil)
					if err != nil {
						t.Fatal(err)
					}
					if err := c.Check(ctx, tx); err != nil {
						t.Errorf("Check: %v", err)
					}
					tx.Rollback()
				}
				if err := first.Release(ctx); err != nil {
					t.Fatalf("Release: %v", err)
				}
				second, err := b.Acquire(ctx, name)
				if err != nil {
					t.Fatalf("Acquire after Release: %v", err)
				}
				if second.Token() <= first.Token() {
					t.Errorf("token %d after %d", second.Token(), first.Token())
				}
				if err := second.Release(ctx); err != nil {
					t.Fatal(err)
				}
			})
		}
	})
}

// TestReplicaRestartAndFailover: every strategy on a MySQL source with one lossless
// semi-synchronous replica (AFTER_SYNC, which the Lockers accept; two containers of
// the pair's image, testdb.StartReplicaPair).
//
// First the replica restarts (a clean shutdown: it comes back with its MEMORY tables
// empty) while every strategy takes and releases locks on the source: it must go on
// applying. Before MySQL migration 0008 every advisory token draw updated a MEMORY
// row, and the restarted replica's applier stopped at the next one with error 1032
// (reproduced on MariaDB 10.11 and MySQL 9.7). Draws write nothing now: the replica
// holds no run of the server.
//
// Then, with a lease of every strategy held on the source, the replica is promoted
// while the source runs on (a failover that left the former source alive: the split
// brain fencing tokens are for). A Locker on the promoted replica must draw tokens
// above the held ones, including forupdate's, which was drawn in a transaction that
// never committed and so never reached the replica: before 0008 the promoted replica
// went on in its source's run and handed that token out again (MariaDB 10.11: held
// 2^44+7, first on the promoted replica 2^44+7).
func TestReplicaRestartAndFailover(t *testing.T) {
	p := testdb.StartReplicaPair(t)
	p.SemiSync(t, "after_sync")
	ctx := testdb.Context(t, 5*time.Minute)
	src := p.OpenSource(t)
	must(t, migrations.Up(ctx, src, sqllock.MySQL))
	name := testdb.Name(t)
	lockers := map[string]sqllock.Locker{}
	last := map[string]int64{}
	take := func(s string, l sqllock.Locker, where string) sqllock.Lease {
		t.Helper()
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatalf("%s on %s: %v", s, where, err)
		}
		if le.Token() <= last[s] {
			t.Fatalf("%s on %s: token %d after %d", s, where, le.Token(), last[s])
		}
		last[s] = le.Token()
		return le
	}
	cycle := func(s string) {
		t.Helper()
		le := take(s, lockers[s], "the source")
		must(t, le.Release(ctx))
	}
	for _, s := range strategies {
		lockers[s.name] = s.new(t, src, sqllock.MySQL)
		cycle(s.name)
	}
	must(t, p.CatchUp(ctx))

	p.RestartReplica(t)
	for range 3 {
		for _, s := range strategies {
			cycle(s.name)
		}
	}
	if err := p.CatchUp(ctx); err != nil {
		t.Fatalf("the replica after its restart and locks taken on the source: %v", err)
	}
	rep := p.OpenReplica(t)
	var runs int
	must(t, rep.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqllock_runs").Scan(&runs))
	if runs != 0 {
		t.Errorf("the restarted replica holds %d runs; want none (its MEMORY table was emptied, and draws write nothing)", runs)
	}

	held := map[string]sqllock.Lease{}
	for _, s := range strategies {
		held[s.name] = take(s.name, lockers[s.name], "the source")
	}
	p.Promote(t)
	for _, s := range strategies {
		promoted := s.new(t, rep, sqllock.MySQL)
		tok := held[s.name].Token()
		for i := range 3 {
			le := take(s.name, promoted, "the promoted replica")
			must(t, le.Release(ctx))
			if i == 0 {
				t.Logf("%s: token held on the former source %d, first on the promoted replica %d", s.name, tok, le.Token())
			}
		}
		if err := held[s.name].Err(); err != nil {
			t.Errorf("%s: the lease on the former source, which runs on: %v; want it held", s.name, err)
		}
		held[s.name].Release(ctx)
	}
}
