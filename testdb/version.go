package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"

	"github.com/sqllock/sqllock"
)

// serverVersion describes the server behind db: its version string and flavour,
// e.g. "PostgreSQL 17.6 (Debian 17.6-1) on x86_64-pc-linux-gnu, ...",
// "9.7.4-2 (MySQL)" or "10.11.11-MariaDB-0+deb12u1 (MariaDB)".
func serverVersion(ctx context.Context, db *sql.DB, d sqllock.Dialect) (string, error) {
	if d == sqllock.Postgres {
		var v string
		if err := db.QueryRowContext(ctx, "SELECT version()").Scan(&v); err != nil {
			return "", err
		}
		return v, nil
	}
	var v string
	if err := db.QueryRowContext(ctx, "SELECT VERSION()").Scan(&v); err != nil {
		return "", err
	}
	flavor := FlavorMySQL
	if strings.Contains(strings.ToLower(v), "mariadb") {
		flavor = FlavorMariaDB
	}
	return fmt.Sprintf("%s (%v)", v, flavor), nil
}

// logServer writes, once per dialect and test binary (get calls it in the same
// sync.Once as the migration), which server the tests run against, so that a
// test report says what was tested. go test shows it with -v, and for a package
// that fails.
func logServer(ctx context.Context, db *sql.DB, d sqllock.Dialect, source string) {
	v, err := serverVersion(ctx, db, d)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testdb: %v server (%s): version unknown: %v\n", d, source, err)
		return
	}
	fmt.Fprintf(os.Stderr, "testdb: %v server: %s [%s]\n", d, v, source)
}
