// Package fence keeps the per-name fencing counters in the sqllock_fence table
// (migration 0001). A counter only ever increases: rows are never deleted by the
// library, and both databases persist committed rows across restarts.
package fence

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"sync"

	"github.com/sqllock/sqllock"
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
	res, err := q.ExecContext(ctx, nextMySQLHead+namekey.MySQLHex(key)+", "+namekey.MySQLHex([]byte(name))+nextMySQLTail)
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

// EpochShift places the epoch of a server's run above the counter in the fencing
// tokens that cost no commit of their own (EpochPostgres, DrawMySQL): a token is
// epoch << EpochShift + a counter that starts again at 1 in every epoch. Tokens of
// the per-name counters of sqllock_fence (earlier versions of advisory) stay below
// 1 << EpochShift unless a name was acquired 2^44 times.
const EpochShift = 44

// EpochPostgres is the SQL expression of a fencing token that costs no commit of its
// own, for strategies whose lock is not a row (advisory): the epoch of the server's
// current run times 2^44 (1 << EpochShift), plus the next value of one sequence
// shared by every name (migration 0007). It is strictly increasing per name across crashes, restarts and
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

// The MySQL tokens that cost no commit (migration mysql/0006): the MEMORY table
// sqllock_run holds one row, v, the last token handed out in the server's current
// run. A draw is one autocommit UPDATE of v that makes the new value the statement's
// insert id (LAST_INSERT_ID(expr)): no InnoDB write, no commit, no flush of the redo
// log (with the binary log on, the server still writes and syncs it for the update).
// The server empties a MEMORY table whenever it starts, so a crash or restart can
// never hand out a value twice: the first draw of a run finds no row, and the run
// records a new epoch, one more than the largest in the InnoDB table sqllock_epoch,
// with a commit (durable with innodb_flush_log_at_trx_commit=1, the default), before
// it seeds v with that epoch << EpochShift. Every token of a run is therefore larger
// than every token of the runs before it. A draw also requires that the counter has
// room in its EpochShift bits; a full one takes a new epoch too.
//
// Replication copies sqllock_run's row with the epochs (the binary log carries the
// MEMORY table's changes, and the emptying at a restart), so the row also names the
// server whose run it counts (server_id, migration mysql/0008), and a draw requires
// it to be the server's own (@@server_id, which replication requires to differ
// between a source and its replicas). A promoted replica therefore records a run of
// its own before its first token, above every epoch it has: with lossless
// semi-synchronous replication that includes its former source's current one, and its
// tokens are larger than every token the source handed out, also those drawn in
// transactions that never committed (forupdate's, raised to the run's epoch) and the
// draws the replica had not applied yet. Galera does not replicate MEMORY tables: each node has
// its own counter, and a node that clients fail back to may keep an older run's
// counter while another node handed out tokens of a newer epoch. With NewestEpoch a
// draw therefore also requires the counter to be of the largest epoch recorded
// (sqllock_epoch is replicated), or takes a new one; that reads the last entry of
// sqllock_epoch's primary key with a shared lock for the length of the statement
// (about 15 % of an uncontended lock's time on MariaDB 10.11 and MySQL 9.7).
//
// Statements that touch sqllock_run hold its table lock (a MEMORY table has no row
// locks) while they run, so none of them may wait for anything that can take long:
// GET_LOCK appears in them only with timeout 0, and the waiting GET_LOCK is a
// statement of its own that reads no table.
type MySQLRun struct {
	// NewestEpoch: the servers the clients use do not replicate sqllock_run to each
	// other (Galera).
	NewestEpoch bool
}

const (
	// myRunRoom: the counter of this server's run (server_id) has room. Under
	// binlog_format=MIXED a statement that reads @@server_id is logged as rows;
	// under STATEMENT (deprecated) the server adds a note that it is unsafe (1592,
	// seen on MariaDB 10.11), and a replica evaluates @@server_id as its own
	// (MySQL: the draw changes no row there) or as the source's (MariaDB's replica
	// thread: the draw applies). Either does no harm: the row names the source, so
	// a promoted replica records a run of its own.
	myRunRoom   = " WHERE id = 1 AND server_id = @@server_id AND (v & 17592186044415) < 17592186044415"
	myRunNewest = " AND v >> 44 = (SELECT MAX(epoch) FROM sqllock_epoch)"
	// notGranted is the insert id of a TryLockDraw statement whose lock was held
	// elsewhere.
	notGranted = 1
)

func (r MySQLRun) guard() string {
	if r.NewestEpoch {
		return myRunRoom + myRunNewest
	}
	return myRunRoom
}

// Draw returns the statement that draws a token: the statement's insert id (see
// Drawn).
func (r MySQLRun) Draw() string {
	return "UPDATE sqllock_run SET v = LAST_INSERT_ID(v + 1)" + r.guard()
}

// TryLockDraw returns the statement that evaluates lock, an expression that takes a
// lock without waiting (GET_LOCK(name, 0)) and is 1 if it did, and draws a token
// only if it did: one round trip for both. The expression is evaluated only if the
// run has a current epoch; Drawn tells the outcomes apart.
func (r MySQLRun) TryLockDraw(lock string) string {
	return "UPDATE sqllock_run SET v = IF(" + lock + " = 1, LAST_INSERT_ID(v + 1), v + 0 * LAST_INSERT_ID(" +
		strconv.Itoa(notGranted) + "))" + r.guard()
}

// Drawn runs stmt (Draw or a TryLockDraw statement) on q, a session in autocommit
// mode, and returns the token drawn, or granted false if the lock of a TryLockDraw
// statement was held elsewhere. When the server's run has no current epoch yet (the
// statement changed nothing and took no lock), it records one (through q) and runs
// stmt again.
func (r MySQLRun) Drawn(ctx context.Context, q Execer, stmt string) (tok int64, granted bool, err error) {
	for attempt := 0; ; attempt++ {
		res, err := q.ExecContext(ctx, stmt)
		if err != nil {
			return 0, false, err
		}
		id, err := res.LastInsertId()
		switch {
		case err != nil:
			return 0, false, err
		case id == notGranted:
			return 0, false, nil
		case id != 0:
			return id, true, nil
		case attempt == 3:
			return 0, false, errors.New("fence: the server's run has no current epoch after recording one")
		}
		if err := r.newRun(ctx, q); err != nil {
			return 0, false, err
		}
	}
}

// EpochSQL is a select-list expression of the epoch of the server's current run (the
// epoch sqllock_run's counter is of), NULL while the run has none (see Epoch).
func (r MySQLRun) EpochSQL() string {
	return "(SELECT v >> " + strconv.Itoa(EpochShift) + " FROM sqllock_run" + r.guard() + ")"
}

// Epoch returns the epoch of the server's current run, recording one (through q) if
// the run has none yet. The epoch is committed before Epoch returns: a later run's is
// larger.
func (r MySQLRun) Epoch(ctx context.Context, q Execer) (int64, error) {
	for attempt := 0; ; attempt++ {
		var e sql.NullInt64
		if err := q.QueryRowContext(ctx, "SELECT "+r.EpochSQL()).Scan(&e); err != nil {
			return 0, err
		}
		switch {
		case e.Valid:
			return e.Int64, nil
		case attempt == 3:
			return 0, errors.New("fence: the server's run has no current epoch after recording one")
		}
		if err := r.newRun(ctx, q); err != nil {
			return 0, err
		}
	}
}

// runMu makes the goroutines of a process that find a run without a current epoch
// record one epoch, not one each.
var runMu sync.Mutex

// newRun gives the server's current run a new epoch unless it has a current one
// already (another session just recorded it): a row of sqllock_epoch one above the
// largest, committed, then the counter sqllock_run seeded with it. Of sessions that
// record epochs at the same time the larger wins (GREATEST); one that loses the race
// for the same epoch number (a duplicate key or a deadlock) leaves it to the other.
func (r MySQLRun) newRun(ctx context.Context, q Execer) error {
	runMu.Lock()
	defer runMu.Unlock()
	// The server's id is written as a literal: a replica applying the row's change as
	// a statement (binlog_format=STATEMENT) must not take the run for its own.
	var current sql.NullInt64
	var server uint64
	if err := q.QueryRowContext(ctx, "SELECT (SELECT 1 FROM sqllock_run"+r.guard()+"), @@server_id").Scan(&current, &server); err != nil {
		return err
	}
	if current.Valid {
		return nil
	}
	res, err := q.ExecContext(ctx, `INSERT INTO sqllock_epoch (epoch, created_at)
SELECT LAST_INSERT_ID(COALESCE(MAX(epoch), 0) + 1), UTC_TIMESTAMP(6) FROM sqllock_epoch`)
	if sqlerr.Is(err, sqlerr.Duplicate) || sqlerr.Is(err, sqlerr.Deadlock) {
		return nil // another session recorded this epoch: the caller draws again
	}
	if err != nil {
		return err
	}
	epoch, err := res.LastInsertId()
	if err != nil {
		return err
	}
	v, sid := strconv.FormatInt(epoch<<EpochShift, 10), strconv.FormatUint(server, 10)
	_, err = q.ExecContext(ctx, "INSERT INTO sqllock_run (id, v, server_id) VALUES (1, "+v+", "+sid+
		") ON DUPLICATE KEY UPDATE v = GREATEST(v, "+v+"), server_id = "+sid)
	return err
}
