package testdb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/sqllock/sqllock"
)

// Statement counting: a database/sql driver wrapper that counts what the client sends
// (BEGIN, COMMIT, ROLLBACK and every executed statement), so statements per
// acquisition are exact on both dialects; on MySQL the server's Questions counter is
// reported beside it (it also counts other clients of the server).

// wrapConnector hands out the connections of inner wrapped by wrap.
type wrapConnector struct {
	inner driver.Connector
	wrap  func(driver.Conn) driver.Conn
}

func (c wrapConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return c.wrap(conn), nil
}

func (c wrapConnector) Driver() driver.Driver { return c.inner.Driver() }

type countingConn struct {
	inner driver.Conn
	n     *atomic.Int64
}

func (c *countingConn) Prepare(q string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), q)
}
func (c *countingConn) Close() error { return c.inner.Close() }
func (c *countingConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// Conn exposes pgx's connection, as pgx's stdlib driver does.
func (c *countingConn) Conn() *pgx.Conn {
	if p, ok := c.inner.(interface{ Conn() *pgx.Conn }); ok {
		return p.Conn()
	}
	return nil
}

func (c *countingConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	st, err := c.inner.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	return &countingStmt{Stmt: st, n: c.n}, nil
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.n.Add(1)
	tx, err := c.inner.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, n: c.n}, nil
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	r, err := c.inner.(driver.ExecerContext).ExecContext(ctx, q, args)
	if err != driver.ErrSkip {
		c.n.Add(1)
	}
	return r, err
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	r, err := c.inner.(driver.QueryerContext).QueryContext(ctx, q, args)
	if err != driver.ErrSkip {
		c.n.Add(1)
	}
	return r, err
}

func (c *countingConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.inner.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (c *countingConn) ResetSession(ctx context.Context) error {
	if r, ok := c.inner.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *countingConn) IsValid() bool {
	if v, ok := c.inner.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

type countingStmt struct {
	driver.Stmt
	n *atomic.Int64
}

func (s *countingStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.n.Add(1)
	return s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *countingStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.n.Add(1)
	return s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}

func (s *countingStmt) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := s.Stmt.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

type countingTx struct {
	driver.Tx
	n *atomic.Int64
}

func (t *countingTx) Commit() error   { t.n.Add(1); return t.Tx.Commit() }
func (t *countingTx) Rollback() error { t.n.Add(1); return t.Tx.Rollback() }

// OpenCounting opens a pool to the test database of d whose statements are counted
// in n: BEGIN, COMMIT, ROLLBACK and every executed statement, as the client sends
// them (a call the driver declines with driver.ErrSkip is counted where database/sql
// then executes it). The wrapped connections expose pgx's *pgx.Conn as pgx's stdlib
// driver does, so code that sends cancel requests works through them.
func OpenCounting(b testing.TB, d sqllock.Dialect, n *atomic.Int64) *sql.DB {
	b.Helper()
	return OpenWrapped(b, d, func(c driver.Conn) driver.Conn { return &countingConn{inner: c, n: n} })
}

// OpenWrapped opens a pool to the test database of d whose driver connections are
// the driver's own wrapped by wrap, as a wrapping driver (tracing, hooks) does.
func OpenWrapped(b testing.TB, d sqllock.Dialect, wrap func(driver.Conn) driver.Conn) *sql.DB {
	b.Helper()
	plain := Open(b, d)
	dc, ok := plain.Driver().(driver.DriverContext)
	if !ok {
		b.Fatalf("driver %T has no connector", plain.Driver())
	}
	inner, err := dc.OpenConnector(DSN(b, d))
	if err != nil {
		b.Fatal(err)
	}
	db := sql.OpenDB(wrapConnector{inner: inner, wrap: wrap})
	b.Cleanup(func() { db.Close() })
	return db
}

// Questions returns MySQL's global Questions counter: statements the server
// received from every client. It returns 0 on PostgreSQL.
func Questions(b testing.TB, db *sql.DB) int64 {
	b.Helper()
	if d, err := sqllock.DetectDialect(context.Background(), db); err != nil || d != sqllock.MySQL {
		return 0
	}
	var name string
	var v int64
	if err := db.QueryRow("SHOW GLOBAL STATUS LIKE 'Questions'").Scan(&name, &v); err != nil {
		b.Fatal(err)
	}
	return v
}
