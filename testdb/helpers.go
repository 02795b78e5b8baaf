package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/sqllock/sqllock"
)

// Context returns a context that ends after d or when the test ends.
func Context(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// CheckLeaks registers a cleanup that fails the test if it leaves goroutines behind.
// Call it before the test opens pools or Lockers: cleanups run last-in first-out, so
// the check runs after theirs.
func CheckLeaks(t testing.TB) {
	ignore := append(leakOptions(), goleak.IgnoreCurrent())
	t.Cleanup(func() {
		if err := goleak.Find(ignore...); err != nil {
			t.Errorf("goroutines leaked: %v", err)
		}
	})
}

// leakOptions are the goroutines of the drivers that outlive a test by design: pgx
// drains a connection it closed after a cancelled statement for up to 15 s in a
// goroutine of its own (pgconn.asyncClose), which a test that cut or cancelled
// statements can leave behind for a moment.
func leakOptions() []goleak.Option {
	return []goleak.Option{goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn.(*PgConn).asyncClose.func1")}
}

// MainLeakFree is Main followed, if every test passed, by a check that no goroutine
// is left behind (goleak): a failing check makes the exit code 1. Call it from
// TestMain: func TestMain(m *testing.M) { os.Exit(testdb.MainLeakFree(m)) }.
func MainLeakFree(m *testing.M) int {
	code := Main(m)
	if code == 0 {
		if err := goleak.Find(leakOptions()...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	return code
}

// Rebind turns the ? placeholders of q into $1, $2, ... for PostgreSQL.
func Rebind(d sqllock.Dialect, q string) string {
	if d != sqllock.Postgres {
		return q
	}
	var b strings.Builder
	n := 0
	for _, r := range q {
		if r == '?' {
			n++
			fmt.Fprintf(&b, "$%d", n)
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// RowMaps reads every row of rows into a map by lower-case column name, for
// statements whose columns vary by server (EXPLAIN, SHOW PROCESSLIST). It closes
// rows.
func RowMaps(t testing.TB, rows *sql.Rows) []map[string]sql.NullString {
	t.Helper()
	out, err := rowMaps(rows)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// rowMaps is RowMaps returning its error.
func rowMaps(rows *sql.Rows) ([]map[string]sql.NullString, error) {
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	var out []map[string]sql.NullString
	for rows.Next() {
		vals := make([]sql.NullString, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return nil, err
		}
		m := make(map[string]sql.NullString, len(cols))
		for i, c := range cols {
			m[strings.ToLower(c)] = vals[i]
		}
		out = append(out, m)
	}
	return out, rows.Err()
}

// ExplainMySQL returns MySQL's plan of query with args, one map per row (lower-case
// column names: "type", "key", ...), in the traditional table form: MySQL 9 prints a
// tree by default (explain_format=TREE), one column that no check of a plan's
// columns would read. It fails the test if the plan has no type column.
func ExplainMySQL(ctx context.Context, t testing.TB, db *sql.DB, query string, args ...any) []map[string]sql.NullString {
	t.Helper()
	rows, err := db.QueryContext(ctx, "EXPLAIN FORMAT=TRADITIONAL "+query, args...)
	if err != nil {
		t.Fatal(err)
	}
	plan := RowMaps(t, rows)
	for _, row := range plan {
		if _, ok := row["type"]; !ok {
			t.Fatalf("EXPLAIN of %q without a type column: %v", query, row)
		}
	}
	return plan
}
