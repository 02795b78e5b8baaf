package migrations

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/golang-migrate/migrate/v4/database"
	"github.com/golang-migrate/migrate/v4/database/multistmt"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
)

// driver is a golang-migrate database.Driver on one pinned *sql.Conn of a pool the
// caller owns. golang-migrate's own pgx and mysql drivers close the *sql.DB they were
// given; this one returns its connection to the pool and leaves the pool open. It
// records versions in its table (MigrationsTable).
type driver struct {
	ctx     context.Context
	conn    *sql.Conn
	dialect sqllock.Dialect
	table   string
	locked  bool
}

func newDriver(ctx context.Context, db *sql.DB, d sqllock.Dialect, table string) (*driver, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	drv := &driver{ctx: ctx, conn: conn, dialect: d, table: table}
	// A user without CREATE rights (migrations run by an administrator) can still
	// read the version and find nothing to do: create nothing if the table is there.
	if _, _, err := drv.Version(); err == nil {
		return drv, nil
	}
	// CREATE TABLE IF NOT EXISTS races with itself on PostgreSQL (a duplicate key in
	// pg_type): create the version table under the migration lock.
	err = drv.Lock()
	if err == nil {
		err = errors.Join(drv.ensureTable(), drv.Unlock())
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return drv, nil
}

func (d *driver) ensureTable() error {
	q := "CREATE TABLE IF NOT EXISTS " + d.table + " (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)"
	_, err := d.conn.ExecContext(d.ctx, q)
	return err
}

// Open is not supported: the driver is built from a *sql.DB by Up and Down.
func (d *driver) Open(string) (database.Driver, error) {
	return nil, errors.New("sqllock migrations: Open by URL is not supported; use migrations.Up")
}

// Close returns the pinned connection to the pool.
func (d *driver) Close() error { return d.conn.Close() }

// lockKey keeps migration runs of this library apart from golang-migrate's own
// (which derives its key from the database and table names with CRC32).
var lockKey = namekey.Int64("sqllock/migrations", MigrationsTable)

// myLockName is the GET_LOCK name of migration runs on a MySQL database: 16 + 48
// characters.
const myLockName = "CONCAT('sqllock_migrate:', LEFT(SHA2(DATABASE(), 256), 48))"

func (d *driver) Lock() error {
	if d.locked {
		return database.ErrLocked
	}
	var err error
	if d.dialect == sqllock.Postgres {
		_, err = d.conn.ExecContext(d.ctx, "SELECT pg_advisory_lock($1)", lockKey)
	} else {
		var got sql.NullInt64
		// GET_LOCK names are server-wide: include the database, hashed, so that the
		// name stays within MySQL's 64 characters (error 4163) for any database name.
		err = d.conn.QueryRowContext(d.ctx, "SELECT GET_LOCK("+myLockName+", 300)").Scan(&got)
		if err == nil && got.Int64 != 1 {
			return database.ErrLocked
		}
	}
	if err != nil {
		return err
	}
	d.locked = true
	return nil
}

func (d *driver) Unlock() error {
	if !d.locked {
		return database.ErrNotLocked
	}
	var err error
	if d.dialect == sqllock.Postgres {
		_, err = d.conn.ExecContext(d.ctx, "SELECT pg_advisory_unlock($1)", lockKey)
	} else {
		_, err = d.conn.ExecContext(d.ctx, "SELECT RELEASE_LOCK("+myLockName+")")
	}
	if err != nil {
		return err
	}
	d.locked = false
	return nil
}

// Run executes a migration one statement at a time. Whole-line "--" comments are
// dropped first; statements of this library's migration files are separated by ';'
// and never contain one.
func (d *driver) Run(migration io.Reader) error {
	text, err := io.ReadAll(migration)
	if err != nil {
		return err
	}
	var runErr error
	err = multistmt.Parse(bytes.NewReader(stripComments(text)), []byte(";"), 1<<20, func(stmt []byte) bool {
		q := strings.TrimSpace(string(bytes.TrimSuffix(bytes.TrimSpace(stmt), []byte(";"))))
		if q == "" {
			return true
		}
		if _, runErr = d.conn.ExecContext(d.ctx, q); runErr != nil {
			runErr = fmt.Errorf("migration statement failed: %w\n%s", runErr, q)
			return false
		}
		return true
	})
	return errors.Join(err, runErr)
}

func stripComments(text []byte) []byte {
	var out []byte
	for _, line := range bytes.SplitAfter(text, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("--")) {
			out = append(out, line...)
		}
	}
	return out
}

func (d *driver) ph(n int) string {
	if d.dialect == sqllock.Postgres {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

func (d *driver) SetVersion(version int, dirty bool) error {
	tx, err := d.conn.BeginTx(d.ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(d.ctx, "DELETE FROM "+d.table); err != nil {
		return err
	}
	// As golang-migrate's drivers do: record NilVersion only when it is dirty.
	if version >= 0 || (version == database.NilVersion && dirty) {
		q := "INSERT INTO " + d.table + " (version, dirty) VALUES (" + d.ph(1) + ", " + d.ph(2) + ")"
		if _, err := tx.ExecContext(d.ctx, q, version, dirty); err != nil {
			return err
		}
	}
	return tx.Commit()
}

func (d *driver) Version() (int, bool, error) {
	var v int
	var dirty bool
	err := d.conn.QueryRowContext(d.ctx, "SELECT version, dirty FROM "+d.table+" LIMIT 1").Scan(&v, &dirty)
	if errors.Is(err, sql.ErrNoRows) {
		return database.NilVersion, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	return v, dirty, nil
}

// Drop drops every table of this library (their names start with "sqllock_") in the
// current schema or database, and nothing else.
func (d *driver) Drop() error {
	var q string
	if d.dialect == sqllock.Postgres {
		q = `SELECT table_name FROM information_schema.tables
		     WHERE table_schema = current_schema() AND table_name LIKE 'sqllock\_%' AND table_type = 'BASE TABLE'`
	} else {
		q = `SELECT table_name FROM information_schema.tables
		     WHERE table_schema = DATABASE() AND table_name LIKE 'sqllock\_%' AND table_type = 'BASE TABLE'`
	}
	rows, err := d.conn.QueryContext(d.ctx, q)
	if err != nil {
		return err
	}
	var tables []string
	for rows.Next() {
		var t string
		if err := rows.Scan(&t); err != nil {
			rows.Close()
			return err
		}
		tables = append(tables, t)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return err
	}
	for _, t := range tables {
		if _, err := d.conn.ExecContext(d.ctx, "DROP TABLE IF EXISTS "+t); err != nil {
			return err
		}
	}
	return d.ensureTable()
}
