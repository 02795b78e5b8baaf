package migrations

import (
	"context"
	"database/sql"

	"github.com/golang-migrate/migrate/v4/database"

	"github.com/sqllock/sqllock"
)

// NewDriver exposes the golang-migrate driver to the shared driver test suite.
func NewDriver(ctx context.Context, db *sql.DB, d sqllock.Dialect, table string) (database.Driver, error) {
	return newDriver(ctx, db, d, table)
}
