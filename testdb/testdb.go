// Package testdb gives tests a migrated database on PostgreSQL or MySQL/MariaDB. Users
// of sqllock can reuse it in their own integration tests.
//
// Where the server comes from:
//
//   - SQLLOCK_TEST_POSTGRES_DSN / SQLLOCK_TEST_MYSQL_DSN, if set, name an existing
//     server (a pgx DSN such as postgres://postgres@127.0.0.1:5432/test?sslmode=disable,
//     and a go-sql-driver DSN such as root@tcp(127.0.0.1:3306)/test).
//   - Otherwise a container is started with testcontainers-go from
//     SQLLOCK_TEST_POSTGRES_IMAGE / SQLLOCK_TEST_MYSQL_IMAGE (defaults DefaultPostgresImage
//     and DefaultMySQLImage): one per dialect per test binary, terminated by Main.
//
// Without either, tests that need a database skip with a message saying how to run
// them, except when the environment variable CI is "true": there they fail.
//
// Tests share the server and isolate themselves by using unique lock names (see Name).
package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql" // registers "mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/migrations"
)

// Default images, used when no image variable is set.
const (
	DefaultPostgresImage = "postgres:15"
	DefaultMySQLImage    = "mysql:8.4"
)

// Environment variables read by this package.
const (
	EnvPostgresDSN   = "SQLLOCK_TEST_POSTGRES_DSN"
	EnvMySQLDSN      = "SQLLOCK_TEST_MYSQL_DSN"
	EnvPostgresImage = "SQLLOCK_TEST_POSTGRES_IMAGE"
	EnvMySQLImage    = "SQLLOCK_TEST_MYSQL_IMAGE"
)

// Dialects lists the dialects every integration suite runs on.
var Dialects = []sqllock.Dialect{sqllock.Postgres, sqllock.MySQL}

type server struct {
	once    sync.Once
	mu      sync.Mutex
	dsn     string // base DSN
	err     error
	managed bool   // started here (a container)
	source  string // where the server comes from, for the log: "container IMAGE" or the DSN variable
	restart func(ctx context.Context, kill bool) (string, error)
	stop    func(context.Context) error
	migrate sync.Once
	migErr  error
}

var servers = map[sqllock.Dialect]*server{sqllock.Postgres: {}, sqllock.MySQL: {}}

// Main runs m and then terminates the containers this binary started. Call it from
// TestMain: func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }.
func Main(m *testing.M) int {
	code := m.Run()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for d, s := range servers {
		s.mu.Lock()
		if s.stop != nil {
			if err := s.stop(ctx); err != nil {
				fmt.Fprintf(os.Stderr, "testdb: stopping %v container: %v\n", d, err)
			}
			s.stop = nil
		}
		s.mu.Unlock()
	}
	return code
}

// CI reports whether the tests run in CI (CI=true), where a missing database fails.
func CI() bool { return os.Getenv("CI") == "true" }

func envFor(d sqllock.Dialect) (dsnVar, imageVar, defImage string) {
	if d == sqllock.Postgres {
		return EnvPostgresDSN, EnvPostgresImage, DefaultPostgresImage
	}
	return EnvMySQLDSN, EnvMySQLImage, DefaultMySQLImage
}

func (s *server) start(d sqllock.Dialect) {
	dsnVar, imageVar, image := envFor(d)
	if dsn := os.Getenv(dsnVar); dsn != "" {
		s.dsn = dsn
		s.source = dsnVar
		return
	}
	if v := os.Getenv(imageVar); v != "" {
		image = v
	}
	s.source = "container " + image
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var err error
	if d == sqllock.Postgres {
		s.dsn, s.restart, s.stop, err = startPostgres(ctx, image)
	} else {
		s.dsn, s.restart, s.stop, err = startMySQL(ctx, image)
	}
	if err != nil {
		s.err = fmt.Errorf("no %v server: %s is not set and starting a container from %s failed: %w", d, dsnVar, image, err)
		return
	}
	s.managed = true
}

// get returns the server of d, started once, or ends the test (skip, or fail in CI).
func get(t testing.TB, d sqllock.Dialect) *server {
	t.Helper()
	s, ok := servers[d]
	if !ok {
		t.Fatalf("testdb: unknown dialect %v", d)
	}
	s.once.Do(func() { s.start(d) })
	if s.err != nil {
		msg := fmt.Sprintf("testdb: %v\nRun Docker (testcontainers-go), or set %s and %s to existing servers.",
			s.err, EnvPostgresDSN, EnvMySQLDSN)
		if CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	s.migrate.Do(func() {
		db, err := open(d, s.currentDSN())
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			err = migrations.Up(ctx, db, d)
			// Once per binary: which server this is (also when migrating failed).
			logServer(ctx, db, d, s.source)
			cancel()
			db.Close()
		}
		s.migErr = err
	})
	if s.migErr != nil {
		t.Fatalf("testdb: migrating %v: %v", d, s.migErr)
	}
	return s
}

func (s *server) currentDSN() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dsn
}

// DriverName returns the database/sql driver name used for d: "pgx" or "mysql".
func DriverName(d sqllock.Dialect) string {
	if d == sqllock.Postgres {
		return "pgx"
	}
	return "mysql"
}

func open(d sqllock.Dialect, dsn string) (*sql.DB, error) {
	return sql.Open(DriverName(d), dsn)
}

// DSN returns the DSN of the migrated server for d, in the form its driver takes.
func DSN(t testing.TB, d sqllock.Dialect) string {
	t.Helper()
	return get(t, d).currentDSN()
}

// Open returns a new connection pool to the migrated database of dialect d. Each call
// returns an independent pool; it is closed when the test ends.
func Open(t testing.TB, d sqllock.Dialect) *sql.DB {
	t.Helper()
	s := get(t, d)
	db, err := open(d, s.currentDSN())
	if err != nil {
		t.Fatalf("testdb: open %v: %v", d, err)
	}
	t.Cleanup(func() { db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		t.Fatalf("testdb: ping %v: %v", d, err)
	}
	return db
}

// CanRestart reports whether Restart works for d: the server is a container started
// by this package.
func CanRestart(t testing.TB, d sqllock.Dialect) bool {
	t.Helper()
	return get(t, d).managed
}

// ChildDialect reads the dialect that a test passed to its child process (the test
// binary run again for one helper test) in the environment variable env, as
// Dialect.String spells it; ok is false in a process that is not such a child.
func ChildDialect(env string) (d sqllock.Dialect, ok bool) {
	switch os.Getenv(env) {
	case "":
		return 0, false
	case sqllock.MySQL.String():
		return sqllock.MySQL, true
	}
	return sqllock.Postgres, true
}

// Restartable reports whether the test can restart or crash the server of d: true
// for a container of this package. Against a server given by DSN it logs that the
// test is not run and returns false; in CI, where every server is a container, it
// fails the test instead.
func Restartable(t testing.TB, d sqllock.Dialect) bool {
	t.Helper()
	if CanRestart(t, d) {
		return true
	}
	if CI() {
		t.Fatalf("testdb: the %v server cannot be restarted in CI", d)
	}
	t.Logf("the %v server comes from a DSN and cannot be restarted here; not run", d)
	return false
}

// Restart stops and starts the container of d, keeping its data. Pools opened before
// reconnect to it (through the DSN returned by later calls of DSN and Open, if the
// mapped port changed). It fails the test when the server is not a container of this
// package: check CanRestart first.
func Restart(t testing.TB, d sqllock.Dialect) { t.Helper(); restart(t, d, false) }

// Crash kills the server of d at once (the engine's SIGKILL, no shutdown: what
// was not flushed to disk is lost) and starts it again, as Restart does.
func Crash(t testing.TB, d sqllock.Dialect) { t.Helper(); restart(t, d, true) }

func restart(t testing.TB, d sqllock.Dialect, kill bool) {
	t.Helper()
	s := get(t, d)
	if !s.managed {
		t.Fatalf("testdb: the %v server comes from %s and cannot be restarted by the test", d, func() string { v, _, _ := envFor(d); return v }())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn, err := s.restart(ctx, kill)
	if err != nil {
		t.Fatalf("testdb: restart %v: %v", d, err)
	}
	s.mu.Lock()
	s.dsn = dsn
	s.mu.Unlock()
}

var seq atomic.Int64

// Name returns a lock name unique to this test binary run, built from parts and the
// test name, so that tests sharing a server never share a lock.
func Name(t testing.TB, parts ...string) string {
	n := seq.Add(1)
	return fmt.Sprintf("%s/%d/%d/%s", t.Name(), os.Getpid(), n, strings.Join(parts, "/"))
}

// ForEach runs f as a subtest for each dialect in Dialects, once the server of that
// dialect is up and migrated: a context f takes at its start is not spent waiting
// for a container to start (MySQL 9.7's took most of a 30 s one in CI).
func ForEach(t *testing.T, f func(t *testing.T, d sqllock.Dialect)) {
	for _, d := range Dialects {
		t.Run(d.String(), func(t *testing.T) {
			get(t, d)
			f(t, d)
		})
	}
}

// OpenIsolated returns a pool to a new, empty and unmigrated schema (PostgreSQL) or
// database (MySQL) on the server of d, dropped when the test ends. Use it for tests
// that create or drop the library's tables, so they never disturb tests running on
// the shared, migrated database.
func OpenIsolated(t testing.TB, d sqllock.Dialect) *sql.DB {
	t.Helper()
	admin := Open(t, d)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	schema := fmt.Sprintf("sqllock_iso_%d_%d", os.Getpid(), seq.Add(1))
	create, drop := "CREATE SCHEMA "+schema, "DROP SCHEMA "+schema+" CASCADE"
	if d == sqllock.MySQL {
		create, drop = "CREATE DATABASE "+schema, "DROP DATABASE "+schema
	}
	if _, err := admin.ExecContext(ctx, create); err != nil {
		t.Fatalf("testdb: %s: %v", create, err)
	}
	db, err := openInSchema(d, DSN(t, d), schema)
	if err != nil {
		t.Fatalf("testdb: open %s: %v", schema, err)
	}
	t.Cleanup(func() {
		db.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(ctx, drop); err != nil {
			t.Errorf("testdb: %s: %v", drop, err)
		}
	})
	return db
}

// OpenIsolatedMigrated is OpenIsolated with the library's migrations applied: a
// migrated schema of the test's own, for tests that change the library's rows in
// ways the shared database must not see (counters set back, epochs aged).
func OpenIsolatedMigrated(ctx context.Context, t testing.TB, d sqllock.Dialect) *sql.DB {
	t.Helper()
	db := OpenIsolated(t, d)
	if err := migrations.Up(ctx, db, d); err != nil {
		t.Fatalf("testdb: migrating an isolated schema: %v", err)
	}
	return db
}
