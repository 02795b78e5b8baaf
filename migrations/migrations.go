// Package migrations holds the schema of every sqllock strategy, as embedded SQL for
// PostgreSQL and MySQL/MariaDB, and applies it with golang-migrate.
//
// Applied versions are recorded in a table of the library's own, MigrationsTable, so
// an application's own golang-migrate table (schema_migrations) is never read or
// written. Every table the library creates starts with "sqllock_".
//
// Up is safe to call from every replica at start-up: runs are serialised with an
// advisory lock (PostgreSQL) or GET_LOCK (MySQL), and a schema that is already
// current is left alone. Statements are sent one at a time, so the DSN needs no
// multiStatements parameter.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/golang-migrate/migrate/v4"
	"github.com/golang-migrate/migrate/v4/source"
	"github.com/golang-migrate/migrate/v4/source/iofs"

	"github.com/sqllock/sqllock"
)

// MigrationsTable is the table in which the applied version is recorded.
const MigrationsTable = "sqllock_schema_migrations"

//go:embed postgres/*.sql mysql/*.sql
var files embed.FS

// FS returns the migration files of dialect d, named as golang-migrate expects
// (NNNN_title.up.sql, NNNN_title.down.sql).
func FS(d sqllock.Dialect) (fs.FS, error) {
	if !d.Valid() {
		return nil, &sqllock.Error{Op: "migrations", Kind: sqllock.ErrInvalidOption, Err: fmt.Errorf("unknown dialect %v", d)}
	}
	return fs.Sub(files, d.String())
}

// Source returns a golang-migrate source.Driver over the embedded migrations of d, for
// users who run migrations their own way. Record them in a table of their own (for
// example with the x-migrations-table=sqllock_schema_migrations URL parameter), never
// in the application's.
func Source(d sqllock.Dialect) (source.Driver, error) {
	sub, err := FS(d)
	if err != nil {
		return nil, err
	}
	return iofs.New(sub, ".")
}

// Up applies every migration of dialect d that db does not have yet.
func Up(ctx context.Context, db *sql.DB, d sqllock.Dialect) error {
	return run(ctx, db, d, "up", (*migrate.Migrate).Up)
}

// Down reverts every migration of dialect d, dropping the library's tables and the
// data in them (held leases, fencing counters). Later tokens restart from 1.
func Down(ctx context.Context, db *sql.DB, d sqllock.Dialect) error {
	return run(ctx, db, d, "down", (*migrate.Migrate).Down)
}

// Version returns the applied version of the library's schema, or 0 if none is.
func Version(ctx context.Context, db *sql.DB, d sqllock.Dialect) (version uint, dirty bool, err error) {
	err = withMigrate(ctx, db, d, "version", func(m *migrate.Migrate) error {
		var e error
		version, dirty, e = m.Version()
		if errors.Is(e, migrate.ErrNilVersion) {
			return nil
		}
		return e
	})
	return version, dirty, err
}

func run(ctx context.Context, db *sql.DB, d sqllock.Dialect, op string, f func(*migrate.Migrate) error) error {
	return withMigrate(ctx, db, d, op, func(m *migrate.Migrate) error {
		if err := f(m); err != nil && !errors.Is(err, migrate.ErrNoChange) {
			return err
		}
		return nil
	})
}

func withMigrate(ctx context.Context, db *sql.DB, d sqllock.Dialect, op string, f func(*migrate.Migrate) error) error {
	wrap := func(err error) error {
		if err == nil {
			return nil
		}
		return &sqllock.Error{Op: "migrations " + op, Dialect: d, Err: err}
	}
	src, err := Source(d)
	if err != nil {
		return err
	}
	drv, err := newDriver(ctx, db, d, MigrationsTable)
	if err != nil {
		src.Close()
		return wrap(err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "sqllock-"+d.String(), drv)
	if err != nil {
		src.Close()
		drv.Close()
		return wrap(err)
	}
	ferr := f(m)
	serr, derr := m.Close()
	return wrap(errors.Join(ferr, serr, derr))
}
