package testdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
)

// OpenAs creates a user of the migrated database of d with exactly the given
// privileges and returns a pool that connects as that user; the user is dropped when
// the test ends. Each grant is a privilege list and an object, as in a GRANT
// statement without GRANT and TO: "SELECT, INSERT ON sqllock_fence" (PostgreSQL:
// tables and sequences of the current schema; MySQL: tables of the current
// database, which OpenAs qualifies). The test's own connection must be allowed to
// create users (the suites connect as postgres / root).
func OpenAs(t testing.TB, d sqllock.Dialect, grants ...string) *sql.DB {
	t.Helper()
	admin := Open(t, d)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var b [6]byte
	rand.Read(b[:])
	user := "sqllock_u_" + hex.EncodeToString(b[:])
	pass := "p" + hex.EncodeToString(b[:])
	exec := func(q string) {
		t.Helper()
		if _, err := admin.ExecContext(ctx, q); err != nil {
			t.Fatalf("testdb: %s: %v", q, err)
		}
	}
	if d == sqllock.Postgres {
		exec(fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s'", user, pass))
		var schema string
		if err := admin.QueryRowContext(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
			t.Fatal(err)
		}
		exec(fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s", schema, user))
		for _, g := range grants {
			exec("GRANT " + g + " TO " + user)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			for _, q := range []string{"REASSIGN OWNED BY " + user + " TO CURRENT_USER", "DROP OWNED BY " + user, "DROP ROLE " + user} {
				if _, err := admin.ExecContext(ctx, q); err != nil {
					t.Errorf("testdb: %s: %v", q, err)
				}
			}
		})
		cfg, err := pgx.ParseConfig(DSN(t, d))
		if err != nil {
			t.Fatal(err)
		}
		cfg.User, cfg.Password = user, pass
		db := stdlib.OpenDB(*cfg)
		t.Cleanup(func() { db.Close() })
		return db
	}
	var database string
	if err := admin.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&database); err != nil {
		t.Fatal(err)
	}
	exec(fmt.Sprintf("CREATE USER '%s'@'%%' IDENTIFIED BY '%s'", user, pass))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(ctx, fmt.Sprintf("DROP USER '%s'@'%%'", user)); err != nil {
			t.Errorf("testdb: DROP USER: %v", err)
		}
	})
	for _, g := range grants {
		privs, obj, ok := strings.Cut(g, " ON ")
		if !ok {
			t.Fatalf("testdb: grant %q has no ON", g)
		}
		if !strings.Contains(obj, ".") {
			obj = "`" + database + "`." + obj
		}
		exec(fmt.Sprintf("GRANT %s ON %s TO '%s'@'%%'", privs, obj, user))
	}
	cfg, err := mysql.ParseDSN(DSN(t, d))
	if err != nil {
		t.Fatal(err)
	}
	cfg.User, cfg.Passwd = user, pass
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}
