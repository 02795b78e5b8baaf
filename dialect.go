package sqllock

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
)

// Dialect names the SQL database a lock runs on. Strategies choose their SQL by it.
type Dialect int

const (
	// Postgres is PostgreSQL (any driver; tested with pgx's stdlib driver).
	Postgres Dialect = iota + 1
	// MySQL is MySQL or MariaDB (tested with github.com/go-sql-driver/mysql).
	MySQL
)

// String returns "postgres" or "mysql".
func (d Dialect) String() string {
	switch d {
	case Postgres:
		return "postgres"
	case MySQL:
		return "mysql"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// Valid reports whether d is Postgres or MySQL.
func (d Dialect) Valid() bool { return d == Postgres || d == MySQL }

// DetectDialect asks the server behind db what it is (SELECT version()) and returns
// Postgres or MySQL. It costs one round trip; call it once at start-up.
func DetectDialect(ctx context.Context, db *sql.DB) (Dialect, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT version()").Scan(&v); err != nil {
		return 0, &Error{Op: "detect-dialect", Err: err}
	}
	if strings.Contains(v, "PostgreSQL") {
		return Postgres, nil
	}
	// MySQL answers "8.0.36", MariaDB "10.11.6-MariaDB-...".
	if len(v) > 0 && v[0] >= '0' && v[0] <= '9' {
		return MySQL, nil
	}
	return 0, &Error{Op: "detect-dialect", Kind: ErrInvalidOption, Err: fmt.Errorf("unknown server version %q", v)}
}
