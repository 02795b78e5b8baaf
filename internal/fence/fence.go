// Package fence keeps the per-name fencing counters in the sqllock_fence table
// (migration 0001). A counter only ever increases: rows are never deleted by the
// library, and both databases persist committed rows across restarts.
package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

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

// The MySQL tokens that cost no commit and write nothing (migration mysql/0008): a
// token is epoch << EpochShift plus the number of UUID_SHORT() values the server
// handed out since its run's epoch was recorded. UUID_SHORT() is a server-wide
// counter, incremented under a mutex on every call, that starts afresh at every
// start of the server; it needs no privilege, and a SELECT that calls it is neither
// a write nor written to the binary log. Each run of the server has a row in the
// MEMORY table sqllock_runs (its epoch, the UUID_SHORT() value when it was recorded,
// base, and the server's @@server_id), which the server empties whenever it starts:
// the first draw of a run finds no row of its own, records a new epoch, one more than
// the largest in the InnoDB table sqllock_epoch, with a commit (durable with
// innodb_flush_log_at_trx_commit=1, the default), and inserts the run's row. Every
// token of a run is therefore larger than every token of the runs before it, and a
// draw is one SELECT: it reads the newest row, and takes it as the current run only
// if the row is the server's own (server_id, which replication requires to differ
// between a source and its replicas) and, with NewestEpoch, of the largest epoch
// recorded. A run whose counter ran out of its EpochShift bits (2^44 values) takes a
// new epoch too.
//
// Replication carries each run's row to the replicas (an INSERT of a new key, which a
// replica applies whether or not it restarted since; draws write nothing, so a
// replica that restarted and lost its MEMORY tables has nothing to fail on). A
// promoted replica finds its former source's row newest and records a run of its own
// before its first token, above every epoch it has: with lossless semi-synchronous
// replication that includes its former source's current one, and its tokens are
// larger than every token the source handed out, also those drawn in transactions
// that never committed (forupdate's, raised to the run's epoch). A server that was a
// source, then a replica without a restart, then a source again finds the other
// source's newer row and takes a new epoch too. Galera does not replicate MEMORY
// tables: each node has its own rows, and a node that clients fail back to may keep
// an older run while another node handed out tokens of a newer epoch; with
// NewestEpoch a draw therefore also requires the run to be of the largest epoch
// recorded (sqllock_epoch is replicated), or takes a new one; but a node that has a
// run of its own does not take one while another node's newest epoch is less than
// two seconds old (the draw fails, sqllock.ErrUnsafeDeployment): clients using two
// nodes at once would record a run in turn on each node, one epoch per hand-off, and
// use up the 2^19 epochs.
//
// The earlier draws (migration mysql/0006: an UPDATE of the counter in the MEMORY
// table sqllock_run, which replication carried to replicas as a row change, and which
// stopped a replica that had restarted with error 1032) are not used any more; tokens
// of this version are above theirs (a new epoch), but processes still running an
// earlier version would go on drawing smaller ones: upgrade them all at once.
//
// Statements that read sqllock_runs hold its table lock (a MEMORY table has no row
// locks; a read lock, shared with other draws) while they run, so none of them may
// wait for anything that can take long: GET_LOCK appears in them only with timeout
// 0, and the waiting GET_LOCK is a statement of its own that reads no table.
type MySQLRun struct {
	// NewestEpoch: the servers the clients use do not replicate sqllock_runs to each
	// other (Galera).
	NewestEpoch bool
}

const (
	// myRunCurrent: the newest run row is this server's. A statement that reads
	// @@server_id is unsafe for statement-based logging, but draws are not logged
	// at all.
	myRunCurrent = " FROM sqllock_runs r WHERE r.epoch = (SELECT MAX(epoch) FROM sqllock_runs) AND r.server_id = @@server_id"
	myRunNewest  = " AND r.epoch = (SELECT MAX(epoch) FROM sqllock_epoch)"
	// myRunToken is a token of the run of row r: epoch << 44 plus the values of the
	// server's UUID_SHORT() counter since base (0, which Drawn takes for a run out
	// of room, if base is above it: a row restored from elsewhere).
	myRunToken = "CAST((r.epoch << 44) + (GREATEST(UUID_SHORT(), r.base) - r.base) AS SIGNED)"
	// notGranted is the token of a TryLockDraw statement whose lock was held
	// elsewhere.
	notGranted = 1
)

func (r MySQLRun) current() string {
	if r.NewestEpoch {
		return myRunCurrent + myRunNewest
	}
	return myRunCurrent
}

// Draw returns the statement that draws a token: its one row's two columns are the
// run's epoch and the token (see Drawn).
func (r MySQLRun) Draw() string {
	return "SELECT r.epoch, " + myRunToken + r.current()
}

// TryLockDraw returns the statement that evaluates lock, an expression that takes a
// lock without waiting (GET_LOCK(name, 0)) and is 1 if it did, and draws a token
// only if it did: one round trip for both. The expression is evaluated only if the
// server has a current run; Drawn tells the outcomes apart.
func (r MySQLRun) TryLockDraw(lock string) string {
	return "SELECT r.epoch, IF(" + lock + " = 1, " + myRunToken + ", " + strconv.Itoa(notGranted) + ")" + r.current()
}

// Drawn runs stmt (Draw or a TryLockDraw statement) on q, a session in autocommit
// mode, and returns the token drawn, or granted false if the lock of a TryLockDraw
// statement was held elsewhere. When the server has no current run (the statement
// returned no row and took no lock), it records one (through q) and runs stmt again;
// when the run's counter is out of room (granted: the lock is taken), it records a
// new one and draws again with Draw.
func (r MySQLRun) Drawn(ctx context.Context, q Execer, stmt string) (tok int64, granted bool, err error) {
	for attempt := 0; ; attempt++ {
		var epoch, t int64
		err := q.QueryRowContext(ctx, stmt).Scan(&epoch, &t)
		switch {
		case err == nil && t == notGranted:
			return 0, false, nil
		case err == nil && t>>EpochShift == epoch && t > epoch<<EpochShift:
			return t, true, nil
		case err != nil && !errors.Is(err, sql.ErrNoRows):
			return 0, false, err
		case attempt == 3:
			return 0, false, errors.New("fence: the server's run has no current epoch after recording one")
		}
		full := int64(0)
		if err == nil { // out of room; the lock, if any, is taken
			full, stmt = epoch, r.Draw()
		}
		if _, err := r.newRun(ctx, q, full); err != nil {
			return 0, false, err
		}
	}
}

// EpochSQL is a select-list expression of the epoch of the server's current run,
// NULL while the server has none (see Epoch).
func (r MySQLRun) EpochSQL() string {
	return "(SELECT r.epoch" + r.current() + ")"
}

// Epoch returns the epoch of the server's current run, recording one (through q) if
// the server has none yet. The epoch is committed before Epoch returns: a later run's
// is larger.
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
		if e, err := r.newRun(ctx, q, 0); err != nil || e != 0 {
			return e, err
		}
	}
}

// otherNodeGrace is how long after another Galera node recorded the newest run a node
// that has a run of its own refuses to record a newer one (NewestEpoch): clients that
// use two nodes at once would otherwise record a run on each node in turn, one epoch
// per hand-off between them (measured: 2,217 epochs in 30 s of two processes on two
// nodes), and use up the epochs (maxEpochs, sqllock_epoch's range) within hours. A
// node that has no run yet (it started since, or never drew) records one at once, as
// after a failover to it.
const otherNodeGrace = 2 * time.Second

// maxEpochs is the number of epochs sqllock_epoch's range allows.
const maxEpochs = 1<<(63-EpochShift) - 1

// myOtherNodeRecent is true when the newest epoch is not one of this node's runs and
// was recorded less than otherNodeGrace ago, while this node has a run of its own.
var myOtherNodeRecent = "COALESCE((SELECT e.created_at > UTC_TIMESTAMP(6) - INTERVAL " +
	strconv.FormatInt(otherNodeGrace.Microseconds(), 10) + " MICROSECOND FROM sqllock_epoch e " +
	"WHERE e.epoch = (SELECT MAX(epoch) FROM sqllock_epoch) AND EXISTS (SELECT 1 FROM sqllock_runs) " +
	"AND NOT EXISTS (SELECT 1 FROM sqllock_runs o WHERE o.epoch = e.epoch)), 0)"

// runMu makes the goroutines of a process that find a server without a current run
// record one epoch, not one each; myRunLock does the same for processes.
var runMu sync.Mutex

// myRunLock is the server's named lock under which a session records a run (its
// name is not hex, so no lock of advisory's is named so), held for two short
// inserts; nothing that holds it waits for another named lock.
const myRunLock = "'sqllock:newrun'"

// newRun gives the server a new run unless it has a current one already (another
// session just recorded it) other than full, the epoch of a run out of room: a row
// of sqllock_epoch one above the largest, committed, then the run's row in
// sqllock_runs. Of sessions that record runs at the same time the larger epoch wins
// (the newest row is the current run); one that loses the race for the same epoch
// number (a duplicate key or a deadlock) leaves it to the other. Sessions of other
// processes wait for each other on a named lock (at most 10 s): without it, with
// NewestEpoch, processes that started runs at once made each other's stale, and
// some gave up (an acquisition failed after 3 runs recorded in turn). With
// NewestEpoch a node that has a run of its own refuses, with an error matching
// sqllock.ErrUnsafeDeployment, to record a newer run while another node's newest
// epoch is less than otherNodeGrace old (clients on two Galera nodes at once; named
// locks are per node, so the named lock does not order them). It returns the epoch
// of the server's current run, the one found or recorded, or 0 if another session
// recorded it.
func (r MySQLRun) newRun(ctx context.Context, q Execer, full int64) (int64, error) {
	runMu.Lock()
	defer runMu.Unlock()
	var got sql.NullInt64
	if err := q.QueryRowContext(ctx, "SELECT GET_LOCK("+myRunLock+", 10)").Scan(&got); err != nil {
		return 0, err
	}
	if got.Int64 != 1 {
		return 0, errors.New("fence: another session has been recording the server's run for 10 s")
	}
	defer q.ExecContext(context.WithoutCancel(ctx), "DO RELEASE_LOCK("+myRunLock+")")
	// The server's id is written as a literal: a replica applying the row's insert as
	// a statement (binlog_format=STATEMENT) must not take the run for its own.
	var current sql.NullInt64
	var server uint64
	var othersRecent bool
	recent := "0"
	if r.NewestEpoch && full == 0 {
		recent = myOtherNodeRecent
	}
	if err := q.QueryRowContext(ctx, "SELECT "+r.EpochSQL()+", @@server_id, "+recent).Scan(&current, &server, &othersRecent); err != nil {
		return 0, err
	}
	if current.Valid && current.Int64 != full {
		return current.Int64, nil
	}
	if othersRecent {
		return 0, fmt.Errorf("fence: %w: another Galera node recorded the newest run less than %v ago, while this node has a run of its own: clients use two nodes at once, which WithGaleraSingleWriter rules out (recording a run in turn on each node would use up the %d epochs)",
			sqllock.ErrUnsafeDeployment, otherNodeGrace, maxEpochs)
	}
	res, err := q.ExecContext(ctx, `INSERT INTO sqllock_epoch (epoch, created_at)
SELECT LAST_INSERT_ID(COALESCE(MAX(epoch), 0) + 1), UTC_TIMESTAMP(6) FROM sqllock_epoch`)
	if sqlerr.Is(err, sqlerr.Duplicate) || sqlerr.Is(err, sqlerr.Deadlock) {
		return 0, nil // another session recorded this epoch: the caller looks again
	}
	if err != nil {
		return 0, err
	}
	epoch, err := res.LastInsertId()
	if err != nil {
		return 0, err
	}
	if _, err := q.ExecContext(ctx, "INSERT INTO sqllock_runs (epoch, base, server_id) VALUES ("+
		strconv.FormatInt(epoch, 10)+", UUID_SHORT(), "+strconv.FormatUint(server, 10)+")"); err != nil {
		return 0, err
	}
	return epoch, nil
}
