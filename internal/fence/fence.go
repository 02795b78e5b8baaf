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
	NextMySQL = nextMySQLHead + `?, ?` + nextMySQLTail
	// The parts of NextMySQL around its two values, for Next's literal form.
	nextMySQLHead = `INSERT INTO sqllock_fence (lock_key, name, token) VALUES (`
	nextMySQLTail = `, 1)
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
	res, err := q.ExecContext(ctx, nextMySQLHead+"X'"+hex.EncodeToString(key)+"', X'"+hex.EncodeToString([]byte(name))+"'"+nextMySQLTail)
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

// EpochPostgres is the SQL expression of a fencing token that costs no commit of its
// own, for strategies whose lock is not a row (advisory): the epoch of the server's
// current run times 2^44, plus the next value of one sequence shared by every name
// (migration 0007). It is strictly increasing per name across crashes, restarts and
// failovers to a replica that has every commit: the sequence never goes back while
// the server runs, and the epoch of a run, committed synchronously before its first
// token, is larger than every earlier one. It is NULL while the run has no epoch yet:
// pass the result to Drawn. Evaluate it after the lock is
// taken, in the same statement or a later one.
const EpochPostgres = "(SELECT epoch FROM sqllock_epoch WHERE started = pg_postmaster_start_time()) * 17592186044416 + nextval('sqllock_token_seq')"

// ensureEpoch records, if it is missing, the epoch of the server's current run: one
// more than the largest, committed synchronously (even where synchronous_commit is
// off), so that it is on disk before a token of the run is handed out.
func ensureEpoch(ctx context.Context, db *sql.DB) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `SELECT set_config('synchronous_commit', 'on', true)
WHERE current_setting('synchronous_commit') IN ('off', 'local')`); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO sqllock_epoch (started, epoch)
SELECT pg_postmaster_start_time(), COALESCE(max(epoch), 0) + 1 FROM sqllock_epoch
ON CONFLICT (started) DO NOTHING`); err != nil {
		return err
	}
	return tx.Commit()
}

// Drawn returns the token a statement drew with EpochPostgres (drawn), or, if it was
// NULL because the server's run had no epoch yet, records the epoch through db and
// draws one on q.
func Drawn(ctx context.Context, drawn sql.NullInt64, q Execer, db *sql.DB) (int64, error) {
	if drawn.Valid {
		return drawn.Int64, nil
	}
	if err := ensureEpoch(ctx, db); err != nil {
		return 0, err
	}
	var tok sql.NullInt64
	if err := q.QueryRowContext(ctx, "SELECT "+EpochPostgres).Scan(&tok); err != nil {
		return 0, err
	}
	if !tok.Valid {
		return 0, errors.New("fence: the epoch of the server's run is missing after it was recorded")
	}
	return tok.Int64, nil
}
