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
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/migrations"
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

// strategy builds a Locker of one strategy on a pool.
type strategy struct {
	name string
	new  func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

var strategies = []strategy{
	{"uniqueindex", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := uniqueindex.New(db, d, uniqueindex.WithTTL(10*time.Second))
		must(t, err)
		t.Cleanup(func() { l.Close() })
		return l
	}},
	{"forupdate", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := forupdate.New(db, d)
		must(t, err)
		return l
	}},
	{"advisory", func(t testing.TB, db *sql.DB, d sqllock.Dialect) sqllock.Locker {
		l, err := advisory.New(db, d)
		must(t, err)
		return l
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
			for _, s := range strategies {
				if s.name == "advisory" {
					continue // needs a table only for its fencing token; checked below
				}
				if err := use(s, 0); err == nil {
					t.Errorf("round %d: %s works after Down: the migrations do not own its tables", round, s.name)
				}
			}
			if err := use(strategies[2], 0); err == nil {
				t.Errorf("round %d: advisory with a token works without sqllock_fence", round)
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
