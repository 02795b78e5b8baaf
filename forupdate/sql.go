package forupdate

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
)

// The SQL of each dialect. Keys are SHA-256 of the name (namekey.Key); the original
// bytes are stored in name for display only. An acquisition is one statement in its
// transaction (for the exceptions see the package documentation, Cost): a locking
// read that waits for the row lock and, unless WithoutToken, once the lock is held,
// draws the new token from a source that is never rolled back (a sequence,
// AUTO_INCREMENT) and stores it in the row, to commit with the work.
// Drawing the token after the wait is what keeps tokens in the order in which the
// lock is granted: a token drawn before the wait could be granted after a larger one.
const (
	// The PostgreSQL locking reads return the row's key and, as since, now(), the
	// start of the transaction: a time at which the session was alive, against which
	// the keepalive compares backend_start and xact_start. They also set the
	// transaction's server-enforced bound, transaction-locally (put back by COMMIT or
	// ROLLBACK): %[1]s stands for boundNow (see newPgStatements). Their target list is
	// computed by the scan below the row locking, so before the wait: nothing in it
	// may depend on the lock being held.
	pgLockFmt = `SELECT lock_key, %[1]s AS since FROM sqllock_rowlock WHERE lock_key = $1 FOR UPDATE`
	// pgLockTimeoutFmt is pgLock with a lock_timeout of $2 set for the rest of the
	// transaction before the wait starts: set_config in the row filter is volatile,
	// so it runs for the matching row, before the row is locked. pgResetTimeout, run
	// once the lock is held, puts the session's value back.
	pgLockTimeoutFmt = `SELECT lock_key, %[1]s AS since FROM sqllock_rowlock WHERE lock_key = $1
AND set_config('lock_timeout', $2, true) IS NOT NULL FOR UPDATE`
	pgTryFmt = `SELECT lock_key, %[1]s AS since FROM sqllock_rowlock WHERE lock_key = $1 FOR UPDATE NOWAIT`
	// pgAnyFmt takes the first free row of $1, in the order given, skipping locked rows.
	pgAnyFmt = `SELECT lock_key, %[1]s AS since FROM sqllock_rowlock WHERE lock_key = ANY($1)
ORDER BY array_position($1, lock_key) LIMIT 1 FOR UPDATE SKIP LOCKED`
	// pgResetTimeout puts the session's lock_timeout back (set_config with a NULL
	// value is a RESET; a lookup in pg_settings costs half a millisecond). It must
	// run on a row that came out of the locking read, once the lock is held.
	pgResetTimeout = `set_config('lock_timeout', NULL, true)`
	// pgResetFmt wraps a locking read (%s) for leases without a token: the outer
	// target list runs on the rows that come out of the locking subquery, so once the
	// row lock is held, and puts the session's lock_timeout back in the same statement.
	pgResetFmt = `SELECT lock_key, since, ` + pgResetTimeout + ` FROM (%s) l`
	// pgDrawFmt wraps a locking read (%[1]s) so that the same statement draws the
	// lease's token and stores it in the row. The token, fence.EpochPostgres (strictly
	// larger than every token drawn before, across crashes: a bare sequence may hand
	// out again, after a crash, a value whose WAL was not flushed, though a holder may
	// have shown it to a resource already), is computed by the target list of t over
	// the rows of the locking subquery, so only for a row whose lock is held, after
	// any wait for it; t is materialised once (it is volatile), so the UPDATE, even
	// when it rechecks a row that a holder updated during the wait (READ COMMITTED),
	// stores the value drawn. (A volatile expression in a FROM-subquery of its own, or
	// in the target list of the locking read, could run before the wait.) The
	// statement returns the key, since and the token drawn, NULL while the server's
	// run has no epoch yet (the row keeps its token then; see Locker.drawnPostgres),
	// and %[2]s: "" or ", " + pgResetTimeout, which RETURNING evaluates on the
	// updated row. No row: the key has no row (or, SKIP LOCKED, every row is held).
	pgDrawFmt = `WITH t AS (SELECT lock_key, since, ` + fence.EpochPostgres + ` AS token FROM (%[1]s) l)
UPDATE sqllock_rowlock r SET token = COALESCE(t.token, r.token), acquired_at = clock_timestamp()
FROM t WHERE r.lock_key = t.lock_key RETURNING t.lock_key, t.since, t.token%[2]s`
	pgSetToken = `UPDATE sqllock_rowlock SET token = $2 WHERE lock_key = $1`
	pgExisting = `SELECT lock_key FROM sqllock_rowlock WHERE lock_key = ANY($1)`
	pgCreate   = `INSERT INTO sqllock_rowlock (lock_key, name, token)
VALUES ($1, $2, nextval('sqllock_rowlock_token_seq')) ON CONFLICT (lock_key) DO NOTHING`
	pgCancel = `SELECT pg_cancel_backend($1)`
	pgPID    = `SELECT pg_backend_pid()`
	// pgActivity finds session $1 in the lease's transaction (xact_start = $2, the
	// transaction's now()) only if it started no later than that transaction: a later
	// session that reuses the pid is not it. It returns the state, the wait event and
	// how long (µs) the state has lasted.
	pgActivity = `SELECT state, wait_event,
  floor(extract(epoch FROM (clock_timestamp() - state_change)) * 1000000)::bigint
FROM pg_stat_activity WHERE pid = $1 AND backend_start <= $2 AND xact_start = $2`

	// The MySQL statements that may wait carry a marker comment (argument 1) by which
	// a waiting statement is found in the processlist to be interrupted, and start
	// with "SELECT " or "REPLACE " (or "INSERT ") for serverWaitBound. The key
	// (argument 2) is a hex literal; argument 3 is "" or " NOWAIT".
	//
	// myLockFmt is the locking read of leases without a token; it returns the
	// session's id. (A token's REPLACE cannot: with a token the id comes from the
	// pinned session, pin.Pool.SessionID, asked once per session.)
	myLockFmt = `SELECT /* %[1]s */ CONNECTION_ID() FROM sqllock_rowlock WHERE lock_key = %[2]s FOR UPDATE%[3]s`
	// myDrawFmt takes the row lock and draws the lease's token in one statement: it
	// replaces the locked row by a copy, which draws a new AUTO_INCREMENT token (the
	// statement's insert id; AUTO_INCREMENT values are not reused after a rollback).
	// The copy's name is read by a locking read in a derived table (a subquery of the
	// table being written is refused otherwise, error 1093), which the server
	// evaluates, waiting for the row lock if need be, before the insert draws its
	// value. It is a single-row REPLACE ... VALUES, which InnoDB's consecutive
	// AUTO_INCREMENT lock mode (MariaDB's default) serves under a short mutex: a
	// REPLACE ... SELECT would take the table's AUTO-INC lock for the statement, and
	// an INSERT creating a row (createRow), then also taking it, would hold it while
	// it waits for that row's lock, stalling every other acquisition. The conflict is
	// on the primary key, not the last unique key, so the server deletes and inserts
	// rather than updating in place. No row: the name is NULL, error 1048.
	myDrawFmt = `REPLACE /* %[1]s */ INTO sqllock_rowlock (lock_key, name, acquired_at) VALUES (%[2]s,
(SELECT name FROM (SELECT name FROM sqllock_rowlock WHERE lock_key = %[2]s FOR UPDATE%[3]s) l), UTC_TIMESTAMP(6))`
	// myAnyFmt has no ORDER BY: InnoDB would lock every row it reads for the sort,
	// not only the one LIMIT keeps. Without it, rows are read (and the first free one
	// locked) in key order. Every key in the list must have a row: at REPEATABLE READ a
	// missing key would be gap-locked for the whole lease (see ensureRows).
	myAnyFmt = `SELECT lock_key, CONNECTION_ID() FROM sqllock_rowlock WHERE lock_key IN (%s)
LIMIT 1 FOR UPDATE SKIP LOCKED`
	myExistingFmt = `SELECT lock_key FROM sqllock_rowlock WHERE lock_key IN (%s)`
	// A duplicate key (1062) means the row exists: the goal. INSERT IGNORE is not
	// used because it also hides truncation and other errors.
	myCreateFmt = `INSERT /* %s */ INTO sqllock_rowlock (lock_key, name) VALUES (?, ?)`
	myVersion   = `SELECT VERSION()`
	myCommitted = `SELECT token FROM sqllock_rowlock WHERE lock_key = ?`
	// myEpochKey is the lock_key of sqllock_rowlock's epoch row (see raiseTokens): no
	// name's SHA-256. myRaisedEpoch reads the epoch its token was raised to.
	myEpochKey    = "x'0000000000000000000000000000000000000000000000000000000000000000'"
	myRaisedEpoch = "(SELECT token >> 44 FROM sqllock_rowlock WHERE lock_key = " + myEpochKey + ")"
)

// myLocking returns the MySQL statement that takes the row lock of key (and, with
// draw, draws the token: myDrawFmt), with marker, not waiting if nowait.
func myLocking(draw bool, marker string, key []byte, nowait bool) string {
	format, tail := myLockFmt, ""
	if draw {
		format = myDrawFmt
	}
	if nowait {
		tail = " NOWAIT"
	}
	return fmt.Sprintf(format, marker, namekey.MySQLHex(key), tail)
}

// pgStatements are the PostgreSQL statements of a Locker's acquisitions: the
// locking reads, wrapped in pgDrawFmt unless WithoutToken. Each returns the key and
// since, then the token drawn (with a token), then, for lockTimeout, the value of
// pgResetTimeout.
type pgStatements struct {
	lock, lockTimeout, try, any string
}

// newPgStatements builds them for transactions bounded by ttl. boundNow is now(),
// computed once the settings that bound the transaction are in place:
// idle_in_transaction_session_timeout (the server ends a transaction idle for
// longer) and tcp_user_timeout (and a session whose client stopped acknowledging),
// both transaction-local.
func newPgStatements(ttl time.Duration, token bool) pgStatements {
	ms := "'" + pin.Millis(ttl) + "'"
	boundNow := "(CASE WHEN set_config('idle_in_transaction_session_timeout', " + ms + ", true) || " +
		"set_config('tcp_user_timeout', " + ms + ", true) IS NOT NULL THEN now() END)"
	read := func(format string) string { return fmt.Sprintf(format, boundNow) }
	wrap := func(read string, reset bool) string {
		if token {
			tail := ""
			if reset {
				tail = ", " + pgResetTimeout
			}
			return fmt.Sprintf(pgDrawFmt, read, tail)
		}
		if reset {
			return fmt.Sprintf(pgResetFmt, read)
		}
		return read
	}
	return pgStatements{
		lock:        wrap(read(pgLockFmt), false),
		lockTimeout: wrap(read(pgLockTimeoutFmt), true),
		try:         wrap(read(pgTryFmt), false),
		any:         wrap(read(pgAnyFmt), false),
	}
}

// myStatements are the MySQL statements that differ between MySQL and MariaDB.
type myStatements struct {
	// activity (a format: the key as a hex literal, the session id) returns COMMAND,
	// TIME, STATE of the session, the server's uptime, and the committed token of the
	// lock row of the key. Literals, not parameters: go-sql-driver would prepare,
	// run and close a statement with parameters, two round trips per keep-alive.
	activity string
	// find returns the ids of the sessions (other than this one) whose statement
	// contains ?.
	find string
	// inTx is the expression of "this session is in a transaction", or NULL.
	inTx string
}

func newMyStatements(flavor int32) myStatements {
	processlist, status, inTx := "performance_schema.processlist", "performance_schema.global_status", "NULL"
	if flavor == flavorMariaDB {
		// MariaDB has no performance_schema.processlist (and its performance_schema is
		// off by default). MySQL 8 and 9 fail every query on
		// information_schema.PROCESSLIST (3854) while any session runs a statement
		// that is not valid utf8mb3, such as ours with a binary key.
		processlist, status, inTx = "information_schema.PROCESSLIST", "information_schema.GLOBAL_STATUS", "@@in_transaction"
	}
	return myStatements{
		activity: "SELECT p.COMMAND, p.TIME, p.STATE, " +
			"(SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM " + status + " WHERE UPPER(VARIABLE_NAME) = 'UPTIME'), " +
			"(SELECT token FROM sqllock_rowlock WHERE lock_key = %s) " +
			"FROM " + processlist + " p WHERE p.ID = %d",
		find: "SELECT ID FROM " + processlist + " WHERE INFO LIKE ? AND ID <> CONNECTION_ID()",
		inTx: inTx,
	}
}

// stillOpen is the check of Lease.myStillOpen: a locking read of the lock row that
// does not wait, returning its token and whether the session is in a transaction
// (MariaDB; NULL on MySQL).
func (m myStatements) stillOpen(key []byte) string {
	return "SELECT token, " + m.inTx + " FROM sqllock_rowlock WHERE lock_key = " + namekey.MySQLHex(key) + " FOR UPDATE NOWAIT"
}

// sending reports whether a MySQL processlist STATE says that the session is writing
// to its client (net_write_timeout may be running).
func sending(state string) bool {
	s := strings.ToLower(state)
	return strings.Contains(s, "to net") || strings.Contains(s, "sending to client")
}

// placeholders is n "?" parameters, comma-separated. (The statements that lock and
// bump a row carry their key and name as hex literals, namekey.MySQLHex, not
// parameters.)
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

// pgSession returns the backend pid of the session behind conn and, when the driver
// is pgx, its *pgconn.PgConn (for out-of-band cancel requests), read without a round
// trip. With another driver the pid is queried and pgc is nil.
func pgSession(ctx context.Context, conn *sql.Conn) (pid int64, pgc *pgconn.PgConn, err error) {
	if pgc = interrupt.PgConn(conn); pgc != nil {
		return int64(pgc.PID()), pgc, nil
	}
	err = conn.QueryRowContext(ctx, pgPID).Scan(&pid)
	return pid, nil, err
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

// cancelOn interrupts, through conn (a connection other than the waiter's), the
// statement that PostgreSQL session pid runs (pg_cancel_backend), or the MySQL
// statement whose text contains marker (KILL QUERY). It reports whether a statement
// was found to interrupt. Neither affects a session between statements.
func (l *Locker) cancelOn(ctx context.Context, conn *sql.Conn, pid int64, marker string) (bool, error) {
	if l.dialect == sqllock.Postgres {
		var ok bool
		err := conn.QueryRowContext(ctx, pgCancel, pid).Scan(&ok)
		return ok, err
	}
	rows, err := conn.QueryContext(ctx, l.myStmts(ctx).find, "%"+marker+"%")
	if err != nil {
		return false, err
	}
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return false, err
		}
		ids = append(ids, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return false, err
	}
	for _, id := range ids {
		// KILL takes no placeholder on MySQL (6413): the id is formatted in.
		if _, err := conn.ExecContext(ctx, "KILL QUERY "+strconv.FormatInt(id, 10)); err != nil {
			return false, err
		}
	}
	return len(ids) > 0, nil
}

// MySQL server flavours, for the statements that differ.
const (
	flavorUnknown int32 = iota
	flavorMariaDB       // SET STATEMENT innodb_lock_wait_timeout = n FOR ...
	flavorMySQL8        // /*+ MAX_EXECUTION_TIME(ms) */ on SELECT
	flavorOther         // no statement-level bound
)

// myFlavor returns the flavour of the MySQL server, asking it once per Locker.
func (l *Locker) myFlavor(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) int32 {
	if f := l.flavor.Load(); f != flavorUnknown {
		return f
	}
	var v string
	if err := q.QueryRowContext(ctx, myVersion).Scan(&v); err != nil {
		return flavorUnknown // ask again next time
	}
	f := flavorOther
	if strings.Contains(strings.ToLower(v), "mariadb") {
		f = flavorMariaDB
	} else if major, _, _ := strings.Cut(v, "."); atoi(major) >= 8 {
		f = flavorMySQL8
	}
	l.flavor.Store(f)
	return f
}

// myStmts returns the flavour's statements (asking the flavour if still unknown: the
// MySQL ones until it is known).
func (l *Locker) myStmts(ctx context.Context) myStatements {
	f := l.myFlavor(ctx, l.db)
	if f == flavorMariaDB {
		return l.myMaria
	}
	return l.myOracle
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}

// serverWaitBound returns stmt (a MySQL statement starting with "SELECT ",
// "REPLACE " or "INSERT ") with a server-side bound of its wait of about wait, for
// the server's flavour f, and whether it could give it one: a backstop that ends the
// wait on the server even if the client can no longer interrupt it. MariaDB takes a
// statement-scoped innodb_lock_wait_timeout in whole seconds (rounded up), for any
// statement; MySQL ignores that as a hint (warning 3637) but ends a SELECT at
// MAX_EXECUTION_TIME (error 3024), and has no statement-scoped bound for anything
// else. (An INSERT creating a lock row only waits for a row that exists, and then
// fails with a duplicate key anyway.)
func serverWaitBound(f int32, wait time.Duration, stmt string) (string, bool) {
	switch f {
	case flavorMariaDB:
		secs := int64((wait + time.Second - 1) / time.Second)
		secs = min(max(secs, 1), 100000000)
		return fmt.Sprintf("SET STATEMENT innodb_lock_wait_timeout = %d FOR %s", secs, stmt), true
	case flavorMySQL8:
		if strings.HasPrefix(stmt, "SELECT ") {
			ms := min(max(int64((wait+time.Millisecond-1)/time.Millisecond), 1), 4294967295)
			return fmt.Sprintf("SELECT /*+ MAX_EXECUTION_TIME(%d) */ %s", ms, stmt[7:]), true
		}
	}
	return stmt, false
}

// newMarker returns a string unique to one attempt, put in a comment of the MySQL
// statements that may wait.
func newMarker() string {
	var b [12]byte
	rand.Read(b[:])
	return "sqllock-wait-" + hex.EncodeToString(b[:])
}

var errNoRow = errors.New("lock row missing")
