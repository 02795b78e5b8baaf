package testdb

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
)

// CheckMySQLStatements prepares each statement (name -> SQL text with ?
// placeholders) on the MySQL server of the tests with an SQL-level PREPARE and
// fails t for every warning or error the server gives about its text, such as 1287
// for syntax it deprecates (deprecated syntax goes away in a later release). The
// binary protocol's prepare, which the driver uses, does not show warnings: this
// does. Nothing runs; the tables must exist (the migrated test database).
func CheckMySQLStatements(t testing.TB, stmts map[string]string) {
	t.Helper()
	db := Open(t, sqllock.MySQL) // may start the server's container: before the deadline
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	names := make([]string, 0, len(stmts))
	for n := range stmts {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if _, err := conn.ExecContext(ctx, "SET @sqllock_check = ?", stmts[n]); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, "PREPARE sqllock_check FROM @sqllock_check"); err != nil {
			t.Errorf("%s: PREPARE: %v", n, err)
			continue
		}
		rows, err := conn.QueryContext(ctx, "SHOW WARNINGS")
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var level, msg string
			var code int
			if err := rows.Scan(&level, &code, &msg); err != nil {
				t.Fatal(err)
			}
			t.Errorf("%s: %s %d: %s", n, level, code, msg)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		rows.Close()
		if _, err := conn.ExecContext(ctx, "DEALLOCATE PREPARE sqllock_check"); err != nil {
			t.Fatal(err)
		}
	}
}
