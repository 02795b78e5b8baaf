// Package prep runs a Locker's statements on MySQL through statements prepared once
// per Locker: go-sql-driver otherwise prepares, executes and closes a statement for
// every call with arguments (three round trips instead of one). On PostgreSQL it
// runs them directly (pgx caches prepared statements per connection itself).
package prep

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"

	"github.com/sqllock/sqllock"
)

// Cache holds the prepared statements of one Locker. No mutex is held across I/O: a
// statement is prepared outside any lock and published with LoadOrStore (the loser
// of a race closes its copy). After Close, Exec no longer prepares and runs its
// queries unprepared; a failed prepare is not remembered, the call simply runs
// unprepared.
type Cache struct {
	db      *sql.DB
	prepare bool
	stmts   sync.Map // query string -> *sql.Stmt
	closed  atomic.Bool
}

// New returns the Cache of a Locker on db of dialect d.
func New(db *sql.DB, d sqllock.Dialect) *Cache {
	return &Cache{db: db, prepare: d == sqllock.MySQL}
}

// Exec runs query with args.
func (c *Cache) Exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if st := c.stmt(ctx, query); st != nil {
		res, err := st.ExecContext(ctx, args...)
		if err == nil || !c.closed.Load() || err.Error() != "sql: statement is closed" {
			return res, err
		}
		// Closed by Close meanwhile: run it unprepared.
	}
	return c.db.ExecContext(ctx, query, args...)
}

// QueryRow runs query with args and returns its row.
func (c *Cache) QueryRow(ctx context.Context, query string, args ...any) *sql.Row {
	if st := c.stmt(ctx, query); st != nil && !c.closed.Load() {
		return st.QueryRowContext(ctx, args...)
	}
	return c.db.QueryRowContext(ctx, query, args...)
}

// Query runs query with args and returns its rows.
func (c *Cache) Query(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	if st := c.stmt(ctx, query); st != nil && !c.closed.Load() {
		rows, err := st.QueryContext(ctx, args...)
		if err == nil || err.Error() != "sql: statement is closed" {
			return rows, err
		}
		// Closed by Close meanwhile: run it unprepared.
	}
	return c.db.QueryContext(ctx, query, args...)
}

// stmt returns the prepared statement of query, preparing it if needed, or nil on
// PostgreSQL, after Close or if preparing failed.
func (c *Cache) stmt(ctx context.Context, query string) *sql.Stmt {
	if !c.prepare {
		return nil
	}
	if v, ok := c.stmts.Load(query); ok {
		return v.(*sql.Stmt)
	}
	if c.closed.Load() {
		return nil
	}
	st, err := c.db.PrepareContext(ctx, query)
	if err != nil {
		return nil
	}
	if v, loaded := c.stmts.LoadOrStore(query, st); loaded {
		st.Close() // not used by anyone yet
		return v.(*sql.Stmt)
	}
	if c.closed.Load() && c.stmts.CompareAndDelete(query, st) {
		// Close ran meanwhile and may not have seen it: this call owns it, unused.
		st.Close()
		return nil
	}
	return st
}

// Close closes the prepared statements without waiting for statements in flight
// (sql.Stmt.Close waits for them): a statement must never wait for Close, nor Close
// for statements. Idempotent.
func (c *Cache) Close() {
	c.closed.Store(true)
	var sts []*sql.Stmt
	c.stmts.Range(func(k, v any) bool {
		if c.stmts.CompareAndDelete(k, v) {
			sts = append(sts, v.(*sql.Stmt))
		}
		return true
	})
	if len(sts) > 0 {
		go func() {
			for _, st := range sts {
				st.Close()
			}
		}()
	}
}
