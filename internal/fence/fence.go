// Package fence keeps the per-name fencing counters in the sqllock_fence table
// (migration 0001). A counter only ever increases: rows are never deleted by the
// library, and both databases persist committed rows across restarts.
package fence

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Execer is what Next needs: a *sql.DB, *sql.Conn or *sql.Tx.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

const (
	nextPostgres = `INSERT INTO sqllock_fence (lock_key, name, token) VALUES ($1, $2, 1)
ON CONFLICT (lock_key) DO UPDATE SET token = sqllock_fence.token + 1 RETURNING token`
	// NextMySQL is the MySQL increment, for callers that prepare it themselves; read
	// its result with MySQLToken. LAST_INSERT_ID(expr) makes the new value the
	// statement's insert id, so one round trip both increments and returns it. A fresh
	// row affects 1 row and has token 1.
	NextMySQL = `INSERT INTO sqllock_fence (lock_key, name, token) VALUES (?, ?, 1)
ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)`
)

// Next increments the counter of name and returns its new value, in one statement.
// Run on a transaction, the increment commits or rolls back with it, and the row
// stays locked until then.
func Next(ctx context.Context, q Execer, d sqllock.Dialect, name string) (int64, error) {
	key := namekey.Key(name)
	if d == sqllock.Postgres {
		var tok int64
		err := q.QueryRowContext(ctx, nextPostgres, key, []byte(name)).Scan(&tok)
		return tok, err
	}
	// Hex literals, not parameters: go-sql-driver would prepare, run and close a
	// statement with parameters (two round trips and a third packet); a statement
	// without any is one round trip, and hex digits cannot inject anything.
	res, err := q.ExecContext(ctx, "INSERT INTO sqllock_fence (lock_key, name, token) VALUES (X'"+
		hex.EncodeToString(key)+"', X'"+hex.EncodeToString([]byte(name))+"', 1)"+
		" ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)")
	if err != nil {
		return 0, err
	}
	return MySQLToken(res)
}

// MySQLToken returns the token set by NextMySQL from its result.
func MySQLToken(res sql.Result) (int64, error) {
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	if n == 1 {
		return 1, nil
	}
	return res.LastInsertId()
}

// retry is the backoff between autocommit attempts of NextAutocommit.
var retry = backoff.Policy{Min: time.Millisecond, Max: 20 * time.Millisecond}

// NextAutocommit is Next on a *sql.DB or *sql.Conn outside any transaction. It retries
// deadlocks and serialization failures (InnoDB can report a deadlock when sessions
// insert the same new key at once) up to 8 times, so they never reach the caller.
func NextAutocommit(ctx context.Context, q Execer, d sqllock.Dialect, name string) (int64, error) {
	for attempt := 0; ; attempt++ {
		tok, err := Next(ctx, q, d, name)
		if err == nil || attempt == 7 {
			return tok, err
		}
		switch sqlerr.Classify(err) {
		case sqlerr.Deadlock, sqlerr.Serialization, sqlerr.LockTimeout:
		default:
			return tok, err
		}
		if serr := backoff.Sleep(ctx, retry.Delay(attempt), nil); serr != nil {
			return 0, err
		}
	}
}

// Current returns the counter of name, or 0 if it was never incremented.
func Current(ctx context.Context, q Execer, d sqllock.Dialect, name string) (int64, error) {
	query := "SELECT token FROM sqllock_fence WHERE lock_key = ?"
	if d == sqllock.Postgres {
		query = "SELECT token FROM sqllock_fence WHERE lock_key = $1"
	}
	var tok int64
	err := q.QueryRowContext(ctx, query, namekey.Key(name)).Scan(&tok)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return tok, err
}
