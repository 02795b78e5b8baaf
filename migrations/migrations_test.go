package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	dt "github.com/golang-migrate/migrate/v4/database/testing"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func tables(t *testing.T, db *sql.DB, d sqllock.Dialect) map[string]bool {
	t.Helper()
	q := `SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()`
	if d == sqllock.MySQL {
		q = `SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()`
	}
	rows, err := db.QueryContext(ctxT(t), q)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		got[n] = true
	}
	return got
}

// TestUpDownUp applies, reverts and re-applies the schema in an isolated schema, next
// to an application's own golang-migrate table, and checks that the application's
// table is untouched throughout.
func TestUpDownUp(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := ctxT(t)
		db := testdb.OpenIsolated(t, d)
		if _, err := db.ExecContext(ctx, "CREATE TABLE schema_migrations (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, "INSERT INTO schema_migrations (version, dirty) VALUES (20240101, false)"); err != nil {
			t.Fatal(err)
		}
		appVersion := func() string {
			var v int64
			var dirty bool
			rows, err := db.QueryContext(ctx, "SELECT version, dirty FROM schema_migrations")
			if err != nil {
				t.Fatal(err)
			}
			defer rows.Close()
			s := ""
			for rows.Next() {
				if err := rows.Scan(&v, &dirty); err != nil {
					t.Fatal(err)
				}
				s += fmt.Sprintf("%d/%v;", v, dirty)
			}
			return s
		}
		want := appVersion()

		src, err := migrations.Source(d)
		if err != nil {
			t.Fatal(err)
		}
		first, err := src.First()
		if err != nil {
			t.Fatal(err)
		}
		src.Close()

		for i, step := range []struct {
			name     string
			run      func(context.Context, *sql.DB, sqllock.Dialect) error
			wantNone bool
		}{
			{"up", migrations.Up, false},
			{"up again (no change)", migrations.Up, false},
			{"down", migrations.Down, true},
			{"up after down", migrations.Up, false},
		} {
			if err := step.run(ctx, db, d); err != nil {
				t.Fatalf("step %d %s: %v", i, step.name, err)
			}
			got := tables(t, db, d)
			if got["sqllock_fence"] == step.wantNone {
				t.Fatalf("step %d %s: sqllock_fence present = %v", i, step.name, got["sqllock_fence"])
			}
			if !got[migrations.MigrationsTable] {
				t.Fatalf("step %d %s: %s missing", i, step.name, migrations.MigrationsTable)
			}
			if a := appVersion(); a != want {
				t.Fatalf("step %d %s: application's schema_migrations changed: %q, want %q", i, step.name, a, want)
			}
			v, dirty, err := migrations.Version(ctx, db, d)
			if err != nil {
				t.Fatal(err)
			}
			if dirty || (step.wantNone && v != 0) || (!step.wantNone && v < first) {
				t.Fatalf("step %d %s: version %d dirty %v", i, step.name, v, dirty)
			}
		}
		if st := db.Stats(); st.InUse != 0 {
			t.Fatalf("connections in use after migrations: %d", st.InUse)
		}
	})
}

// TestConcurrentUp runs Up from several replicas at once on an empty schema.
func TestConcurrentUp(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := ctxT(t)
		db := testdb.OpenIsolated(t, d)
		var wg sync.WaitGroup
		errs := make([]error, 6)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = migrations.Up(ctx, db, d)
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		if !tables(t, db, d)["sqllock_fence"] {
			t.Fatal("sqllock_fence missing after concurrent Up")
		}
	})
}

// TestDriverConformance runs golang-migrate's shared driver test suite on the driver
// Up and Down use.
func TestDriverConformance(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.OpenIsolated(t, d)
		drv, err := migrations.NewDriver(ctxT(t), db, d, "sqllock_conformance_migrations")
		if err != nil {
			t.Fatal(err)
		}
		dt.Test(t, drv, []byte("CREATE TABLE sqllock_conformance (id int); SELECT 1;"))
		if err := drv.Close(); err != nil {
			t.Fatal(err)
		}
		if err := db.PingContext(ctxT(t)); err != nil {
			t.Fatalf("driver Close closed the caller's pool: %v", err)
		}
	})
}

func TestInvalidDialect(t *testing.T) {
	if _, err := migrations.Source(sqllock.Dialect(0)); !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Fatalf("Source(0) = %v, want ErrInvalidOption", err)
	}
}

// TestLongDatabaseName: on MySQL, GET_LOCK names may have 64 characters (error 4163
// beyond); the migration lock of a database whose name has 64 characters, MySQL's
// longest, still works.
func TestLongDatabaseName(t *testing.T) {
	d := sqllock.MySQL
	admin := testdb.Open(t, d)
	ctx := ctxT(t)
	name := fmt.Sprintf("sqllock_iso_%d_", os.Getpid())
	name += strings.Repeat("x", 64-len(name))
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.ExecContext(context.Background(), "DROP DATABASE "+name) })
	cfg, err := mysql.ParseDSN(testdb.DSN(t, d))
	if err != nil {
		t.Fatal(err)
	}
	cfg.DBName = name
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := migrations.Up(ctx, db, d); err != nil {
		t.Fatalf("Up in a database with a 64-character name: %v", err)
	}
	if v, _, err := migrations.Version(ctx, db, d); err != nil || v == 0 {
		t.Fatalf("Version: %d, %v", v, err)
	}
}
