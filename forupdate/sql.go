package forupdate

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// The SQL of each dialect. Keys are SHA-256 of the name (namekey.Key); the original
// bytes are stored in name for display only. An acquisition is two statements in its
// transaction: a locking read that waits for the row lock, then, once the lock is
// held, one that draws the new token from a source that is never rolled back (a
// sequence, AUTO_INCREMENT) and stores it in the row, to commit with the work.
const (
	pgLock = `SELECT 1 FROM sqllock_rowlock WHERE lock_key = $1 FOR UPDATE`
	// pgLockTimeout is pgLock with a lock_timeout of $2 set for the rest of the
	// transaction before the wait starts: set_config in the row filter is volatile,
	// so it runs for the matching row, before the row is locked. pgBumpReset puts the
	// session's value back.
	pgLockTimeout = `SELECT 1 FROM sqllock_rowlock WHERE lock_key = $1
AND set_config('lock_timeout', $2, true) IS NOT NULL FOR UPDATE`
	pgTry = `SELECT 1 FROM sqllock_rowlock WHERE lock_key = $1 FOR UPDATE NOWAIT`
	// pgAny takes the first free row of $1, in the order given, skipping locked rows.
	pgAny = `SELECT lock_key FROM sqllock_rowlock WHERE lock_key = ANY($1)
ORDER BY array_position($1, lock_key) LIMIT 1 FOR UPDATE SKIP LOCKED`
	pgBump = `UPDATE sqllock_rowlock SET token = nextval('sqllock_rowlock_token_seq'),
acquired_at = clock_timestamp() WHERE lock_key = $1 RETURNING token`
	pgBumpReset = `UPDATE sqllock_rowlock SET token = nextval('sqllock_rowlock_token_seq'),
acquired_at = clock_timestamp() WHERE lock_key = $1
AND set_config('lock_timeout', (SELECT reset_val FROM pg_settings WHERE name = 'lock_timeout'), true) IS NOT NULL
RETURNING token`
	pgExisting = `SELECT lock_key FROM sqllock_rowlock WHERE lock_key = ANY($1)`
	pgCreate   = `INSERT INTO sqllock_rowlock (lock_key, name, token)
VALUES ($1, $2, nextval('sqllock_rowlock_token_seq')) ON CONFLICT (lock_key) DO NOTHING`
	pgCancel  = `SELECT pg_cancel_backend($1)`
	pgPID     = `SELECT pg_backend_pid()`
	pgSession = `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`

	// The MySQL locking reads return the session id, and carry a marker comment
	// (%s) by which a waiting statement is found in the PROCESSLIST to be
	// interrupted; the connection id is not known before the statement returns.
	myLockFmt = `SELECT /* %s */ CONNECTION_ID() FROM sqllock_rowlock WHERE lock_key = ? FOR UPDATE`
	myTry     = `SELECT CONNECTION_ID() FROM sqllock_rowlock WHERE lock_key = ? FOR UPDATE NOWAIT`
	// myAnyFmt has no ORDER BY: InnoDB would lock every row it reads for the sort,
	// not only the one LIMIT keeps. Without it, rows are read (and the first free one
	// locked) in key order.
	myAnyFmt = `SELECT lock_key, name, CONNECTION_ID() FROM sqllock_rowlock WHERE lock_key IN (%s)
LIMIT 1 FOR UPDATE SKIP LOCKED`
	// myBump replaces the locked row by a new one, which draws a new AUTO_INCREMENT
	// token (the statement's insert id). The conflict is on the primary key, not the
	// last unique key, so the server deletes and inserts rather than updating in place.
	myBump        = `REPLACE INTO sqllock_rowlock (lock_key, name, acquired_at) VALUES (?, ?, UTC_TIMESTAMP(6))`
	myExistingFmt = `SELECT lock_key FROM sqllock_rowlock WHERE lock_key IN (%s)`
	// A duplicate key (1062) means the row exists: the goal. INSERT IGNORE is not
	// used because it also hides truncation and other errors.
	myCreateFmt = `INSERT /* %s */ INTO sqllock_rowlock (lock_key, name) VALUES (?, ?)`
	myFind      = `SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE ? AND ID <> CONNECTION_ID()`
	myCancel    = `KILL QUERY ?`
	mySession   = `SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?`
)

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}

func anyArgs(keys [][]byte, times int) []any {
	args := make([]any, 0, len(keys)*times)
	for i := 0; i < times; i++ {
		for _, k := range keys {
			args = append(args, k)
		}
	}
	return args
}

// pgSessionID returns the backend pid of the session behind conn, read from pgx
// without a round trip when the driver is pgx.
func pgSessionID(ctx context.Context, conn *sql.Conn) (int64, error) {
	var pid int64
	err := conn.Raw(func(dc any) error {
		if p, ok := dc.(interface{ Conn() *pgx.Conn }); ok {
			pid = int64(p.Conn().PgConn().PID())
		}
		return nil
	})
	if err == nil && pid != 0 {
		return pid, nil
	}
	err = conn.QueryRowContext(ctx, pgPID).Scan(&pid)
	return pid, err
}

// createRow makes sure the row of key exists, in autocommit on conn (never inside a
// transaction that waits for the row: see the package documentation).
func createRow(ctx context.Context, conn *sql.Conn, d sqllock.Dialect, key []byte, name, marker string) error {
	if d == sqllock.Postgres {
		_, err := conn.ExecContext(ctx, pgCreate, key, []byte(name))
		return err
	}
	_, err := conn.ExecContext(ctx, fmt.Sprintf(myCreateFmt, marker), key, []byte(name))
	if sqlerr.Is(err, sqlerr.Duplicate) {
		return nil
	}
	return err
}

// missingRows returns the indexes of keys that have no row, with a plain
// (non-locking) read.
func missingRows(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, d sqllock.Dialect, keys [][]byte) ([]int, error) {
	var rows *sql.Rows
	var err error
	if d == sqllock.Postgres {
		rows, err = q.QueryContext(ctx, pgExisting, keys)
	} else {
		rows, err = q.QueryContext(ctx, fmt.Sprintf(myExistingFmt, placeholders(len(keys))), anyArgs(keys, 1)...)
	}
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	have := make(map[string]bool, len(keys))
	for rows.Next() {
		var k []byte
		if err := rows.Scan(&k); err != nil {
			return nil, err
		}
		have[string(k)] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var missing []int
	for i, k := range keys {
		if !have[string(k)] {
			missing = append(missing, i)
		}
	}
	return missing, nil
}

// sessionAlive asks, from another pooled connection, whether session id still exists.
func sessionAlive(ctx context.Context, db *sql.DB, d sqllock.Dialect, id int64) (bool, error) {
	q := mySession
	if d == sqllock.Postgres {
		q = pgSession
	}
	var n int
	if err := db.QueryRowContext(ctx, q, id).Scan(&n); err != nil {
		return false, err
	}
	return n > 0, nil
}

// cancelStatement interrupts, from another pooled connection, the statement that
// PostgreSQL session pid runs (pg_cancel_backend), or the MySQL statement whose text
// contains marker (KILL QUERY). Neither affects a session between statements.
func cancelStatement(ctx context.Context, db *sql.DB, d sqllock.Dialect, pid int64, marker string) error {
	if d == sqllock.Postgres {
		_, err := db.ExecContext(ctx, pgCancel, pid)
		return err
	}
	rows, err := db.QueryContext(ctx, myFind, "%"+marker+"%")
	if err != nil {
		return err
	}
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return err
		}
		ids = append(ids, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return err
	}
	for _, id := range ids {
		if _, err := db.ExecContext(ctx, myCancel, id); err != nil {
			return err
		}
	}
	return nil
}

// newMarker returns a string unique to one attempt, put in a comment of the MySQL
// statements that may wait.
func newMarker() string {
	var b [12]byte
	rand.Read(b[:])
	return "sqllock-wait-" + hex.EncodeToString(b[:])
}

var errNoRow = errors.New("lock row missing")
