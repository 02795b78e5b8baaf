package wait

import (
	"context"
	"database/sql"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Line is the server-side waiting line of one Locker of a row strategy: a session
// lock per lock key (pg_advisory_lock, GET_LOCK), the line lock, that the contended
// acquirers of every process queue for in the database. The server grants it in the
// order of the requests, so contended acquisitions are granted across processes in
// FIFO order, and the waiters sleep in the server instead of polling: a waiter's
// statement enters the line and, once its turn comes, makes its attempt; the holder
// that came through the line gives the line lock back in its release statement, so a
// contended acquisition costs two statements.
//
// The line lock is only a waiting aid: the lease row decides who holds the lock.
// A holder that did not come through the line is waited for in the line as before
// (notifications, polling); a line lock left with a session that no longer holds
// the lease (a partitioned or frozen holder, a pooler that moved the session) delays
// the waiters at most by the wait of one entry (Line.wait), after which they attempt
// directly and stop using the line of that key for a while.
//
// A turn pins one pooled connection from the statement that enters the line until
// the release (or until the waiter gives up), with the session bound of internal/pin
// (a session idle for longer than the TTL is ended by the server, which frees the
// line lock). A Locker has at most maxTurns turns out; beyond that, waiters wait
// without the line.
type Line struct {
	db      *sql.DB
	dialect sqllock.Dialect
	space   string // keeps the lines of strategies apart
	pins    *pin.Pool
	log     *slog.Logger
	max     int
	wait    time.Duration // longest wait of one entry
	unlock  string        // unlockSQL

	mu     sync.Mutex
	seen   expiring // keys seen contended, until contendedFor after
	stale  expiring // keys whose line is not used, until staleFor after
	out    int
	closed bool
	off    bool // the line lock did not stay with its session: never used again
}

// Timings of the line.
const (
	// contendedFor is how long after contention was last seen an acquisition of the
	// key goes to the line at once, without a first attempt of its own.
	contendedFor = 2 * time.Second
	// staleFor is how long the line of a key is not used after its line lock turned
	// out to be held by a session that did not hold the lease.
	staleFor = 30 * time.Second
	// maxTurns caps the turns out of one Locker whose pool has no limit.
	maxTurns = 16
)

// NewLine returns the line of a Locker of strategy space on db, whose sessions are
// bounded by ttl. An entry waits at most the TTL (or poll, if longer) before the
// waiter makes an attempt of its own: the line lock of a session that no longer
// holds the lease is freed by the server within the TTL (the session's bound), so a
// longer wait would add nothing, and a shorter one would send the waiters of a long
// hold to the back of the line over and over. The Locker's pool, as configured when
// New is called, caps the turns out at a quarter of its connections (none for a pool
// of fewer than 4), and 16 for a pool without a limit.
func NewLine(db *sql.DB, d sqllock.Dialect, space string, ttl, poll time.Duration, log *slog.Logger) *Line {
	n := maxTurns
	if m := db.Stats().MaxOpenConnections; m > 0 {
		n = min(n, m/4)
	}
	ln := &Line{
		db: db, dialect: d, space: space, pins: pin.New(db, d, ttl, log), log: log, max: n,
		wait: max(poll, ttl),
		seen: expiring{}, stale: expiring{},
	}
	ln.unlock = ln.unlockSQL()
	return ln
}

// Close returns the kept sessions to the pool. Turns out stay valid.
func (ln *Line) Close() {
	ln.mu.Lock()
	ln.closed = true
	ln.mu.Unlock()
	ln.pins.Close()
}

// Contended reports whether key was seen contended recently: an acquisition then
// enters the line at once.
func (ln *Line) Contended(key string) bool {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	now := time.Now()
	return ln.seen.live(key, now) && !ln.stale.live(key, now)
}

// Saw records that key is contended (an attempt found it held, a waiter waited in
// line, or a release found someone in line).
func (ln *Line) Saw(key string) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	ln.seen.set(key, time.Now(), contendedFor)
}

// expiring is a set of keys, each until a time of its own, bounded: a full set
// drops its expired keys before it takes another.
type expiring map[string]time.Time

// set puts key in the set for d from now.
func (m expiring) set(key string, now time.Time, d time.Duration) {
	if len(m) >= 4096 {
		for k, until := range m {
			if !now.Before(until) {
				delete(m, k)
			}
		}
	}
	m[key] = now.Add(d)
}

// live reports whether key is in the set at now (and drops it if it expired).
func (m expiring) live(key string, now time.Time) bool {
	until, ok := m[key]
	if ok && !now.Before(until) {
		delete(m, key)
		return false
	}
	return ok
}

// MarkStale stops the use of the line of key for a while: an entry's wait ran out,
// and an attempt without the line then got the lock, so the line lock is held by a
// session that does not hold the lease (a partitioned or frozen holder, a session a
// pooler handed to another client).
func (ln *Line) MarkStale(key string) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	ln.stale.set(key, time.Now(), staleFor)
	delete(ln.seen, key)
	ln.log.Debug("sqllock/"+ln.space+": the line lock of a key is held by a session that does not hold the lease; waiting without the line for a while", "for", staleFor)
}

// Take returns a turn for key: a pinned session, not yet in the line. It returns nil
// if the Locker has its maximum of turns out, the line of key is not to be used, or
// no session could be had.
func (ln *Line) Take(ctx context.Context, key []byte) *Turn {
	ln.mu.Lock()
	if ln.closed || ln.off || ln.out >= ln.max || ln.stale.live(string(key), time.Now()) {
		ln.mu.Unlock()
		return nil
	}
	ln.out++
	ln.mu.Unlock()
	t := &Turn{ln: ln, key: key}
	conn, err := ln.pins.Get(ctx)
	if err == nil && ln.dialect == sqllock.MySQL {
		t.sid, err = ln.pins.SessionID(ctx, conn)
		if err != nil {
			ln.pins.Discard(conn)
		}
	}
	if err != nil {
		ln.mu.Lock()
		ln.out--
		ln.mu.Unlock()
		return nil
	}
	t.conn = conn
	return t
}

// Turn is one waiter's place in the line: a pinned session, which holds the line
// lock of its key once In is set. Not safe for concurrent use.
type Turn struct {
	ln    *Line
	conn  *sql.Conn
	sid   int64 // MySQL session id
	key   []byte
	in    bool // the session holds the line lock
	dirty bool // the session must be discarded
	done  bool
}

// Dirty reports whether the turn's session is to be discarded.
func (t *Turn) Dirty() bool { return t.dirty }

// In reports whether the turn's session holds the line lock.
func (t *Turn) In() bool { return t != nil && t.in }

// Entered records that the turn's session now holds the line lock (its statement
// entered the line).
func (t *Turn) Entered() { t.in = true }

// Discard gives the turn up and discards its session, which may hold the line lock
// or not (the server frees what it held).
func (t *Turn) Discard(ctx context.Context) {
	t.dirty = true
	t.Leave(ctx)
}

// Run runs stmt on the turn's session, interrupting its wait on the server when ctx
// ends (a cancel request, KILL QUERY). After an interrupt whose effect is uncertain
// or a broken connection the session is discarded at Leave, which frees the line
// lock on the server.
func (t *Turn) Run(ctx context.Context, label string, stmt func(qctx context.Context, conn *sql.Conn) error) error {
	target := interrupt.Target{PgConn: interrupt.PgConn(t.conn), Label: label}
	if t.ln.dialect == sqllock.MySQL {
		target.Kill = interrupt.KillQuery(t.sid)
	}
	dirty, err := interrupt.Interrupter{DB: t.ln.db, Logger: t.ln.log}.Run(ctx, target, false,
		func(qctx context.Context) error { return stmt(qctx, t.conn) })
	if dirty || sqlerr.Is(err, sqlerr.SessionLost) || (err != nil && ctx.Err() != nil) {
		t.dirty = true
	}
	return err
}

// Leave gives the turn up: it gives the line lock back if the session still holds
// it, and returns the session (or discards it, which frees everything it held).
// Safe to call more than once and on a nil Turn.
func (t *Turn) Leave(ctx context.Context) {
	if t == nil || t.done {
		return
	}
	t.done = true
	ln := t.ln
	defer func() {
		ln.mu.Lock()
		ln.out--
		ln.mu.Unlock()
	}()
	if !t.dirty && t.in {
		gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), interrupt.Grace)
		_, err := t.conn.ExecContext(gctx, ln.unlock, ln.unlockArgs(t.key)...)
		cancel()
		t.dirty = err != nil
	}
	if t.dirty {
		ln.pins.Discard(t.conn)
		return
	}
	ln.pins.Put(t.conn)
}

// Released records the outcome of a release statement that also gave the line lock
// back (see PgRelease, MyRelease): unlocked tells that it did; inLine that another
// session took the line lock at once (someone was waiting: the key is contended).
func (t *Turn) Released(unlocked, inLine bool) {
	if unlocked {
		t.in = false
	} else if t.in {
		// The session that entered the line does not hold its lock: the statements
		// of one connection reach different server sessions. The line cannot work.
		t.ln.Off("the line lock was not held by the session that took it")
		t.dirty = true // the lock is somewhere else; this session is of no use
	}
	if inLine {
		t.ln.Saw(string(t.key))
	}
}

// Wait is the longest wait of one entry, for the strategies' entry statements: the
// line's, and never past ctx's deadline.
func (ln *Line) Wait(ctx context.Context) time.Duration {
	d := ln.wait
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, max(time.Until(dl), time.Millisecond))
	}
	return d
}

// EntryContext bounds a statement that enters the line: its wait (Wait) and then an
// attempt of at most attempt. Unlike an ordinary attempt's, it ends with ctx: a
// waiter whose caller gives up is interrupted on the server (Turn.Run) rather than
// left queued for the line lock; a grant that comes at that instant is given back by
// the caller, as always.
func (ln *Line) EntryContext(ctx context.Context, attempt time.Duration) (context.Context, context.CancelFunc, time.Duration) {
	w := ln.Wait(ctx)
	c, cancel := context.WithTimeout(ctx, w+attempt)
	return c, cancel, w
}

// PgLineKey is the SQL expression of the PostgreSQL advisory key (bigint) of the
// line of the lock key keySQL (a bytea parameter) of strategy space: advisory keys
// are per database, and the schema the session works in (current_schema(), where
// its tables are) is part of it, computed by the server in the statement.
func PgLineKey(space, keySQL string) string { return PgLineKeyOf("'"+space+"'", keySQL) }

// PgLineKeyOf is PgLineKey with the strategy's name given as SQL too (spaceSQL), for
// operators' tools that compute the keys of several strategies in one statement.
func PgLineKeyOf(spaceSQL, keySQL string) string {
	return "hashtextextended(COALESCE(current_schema(), '') || '/sqllock/line/' || " + spaceSQL + " || '/' || encode(" + keySQL + ", 'hex'), 0)"
}

// PgKey is PgLineKey of the Locker's strategy.
func (ln *Line) PgKey(keySQL string) string { return PgLineKey(ln.space, keySQL) }

// MyName is the SQL expression of the MySQL GET_LOCK name of the line of a key, whose
// SQL is keySQL (a "?" parameter, or namekey.MySQLHex): the database's name is part of it
// (GET_LOCK names are server-wide), computed by the server in the statement; 63
// characters.
func (ln *Line) MyName(keySQL string) string { return MyLineName(ln.space, keySQL) }

// MyLineName is Line.MyName for the lines of strategy space.
func MyLineName(space, keySQL string) string { return MyLineNameOf("'"+space+"'", keySQL) }

// MyLineNameOf is MyLineName with the strategy's name given as SQL too (spaceSQL).
func MyLineNameOf(spaceSQL, keySQL string) string {
	return "CONCAT('" + MyLinePrefix + "', LEFT(SHA2(" + myLineID(spaceSQL, keySQL) + ", 256), 54))"
}

// myLineID is what the GET_LOCK names of the line of a key are hashed from: the
// database, the strategy and the key.
func myLineID(spaceSQL, keySQL string) string {
	return "CONCAT_WS(':', COALESCE(DATABASE(), ''), " + spaceSQL + ", HEX(" + keySQL + "))"
}

// MyLinePrefix begins the GET_LOCK name of every line (MyLineName).
const MyLinePrefix = "sqllock:l:"

// MyTicketName is the SQL expression of the GET_LOCK name of ticket ticketSQL (an SQL
// number) of the fairqueue lock key keySQL on MySQL: a waiter's session holds it
// while it waits in the line, and until its release, and its successor waits for
// it. It is MyTicketPrefix, 34 hexadecimal digits of the hash MyLineName takes 54 of,
// ':' and the ticket: at most 64 characters.
func MyTicketName(keySQL, ticketSQL string) string {
	return "CONCAT('" + MyTicketPrefix + "', LEFT(SHA2(" + myLineID("'fairqueue'", keySQL) + ", 256), 34), ':', " + ticketSQL + ")"
}

// MyTicketPrefix begins the GET_LOCK name of every fairqueue ticket (MyTicketName).
const MyTicketPrefix = "sqllock:q:"

// LineSpaces are the strategies that use a server-side line (fairqueue's MySQL
// waiters hold and wait for locks of their tickets instead: MyTicketName).
var LineSpaces = []string{"uniqueindex", "optimistic"}

// PgEnter is the SQL expression that enters the line of PostgreSQL advisory key k
// (a PgLineKey expression) and evaluates to whether the session had to wait: it
// takes the line lock at once if it is free, else waits for it with a lock_timeout of
// ms (a parameter, text, milliseconds), which it turns off once the lock is held, so
// that the rest of the statement is bounded by its caller's context alone (a
// lock_timeout that a role, a database or the DSN sets is not put back: a timeout of
// the statement's own waits must never be taken for the entry's). The evaluation
// order is that of the CASE. A statement that fails with a lock timeout (55P03) did
// not enter the line.
//
// It evaluates to NULL, and takes nothing, when the server session is not the one
// the client connected to: pg_backend_pid() differs from pid (a parameter, the
// backend pid pgx received when it connected, PgPID), which is what a pooler such
// as pgbouncer shows. A session lock does not stay with its client behind a
// transaction-pooling proxy, so the line is not used there (Line.Off).
func PgEnter(k, ms, pid string) string {
	return "CASE WHEN pg_backend_pid() <> " + pid + " THEN NULL" +
		" WHEN pg_try_advisory_lock(" + k + ") THEN false" +
		" WHEN set_config('lock_timeout', " + ms + ", true) IS NULL THEN NULL" +
		" WHEN pg_advisory_lock(" + k + ") IS NULL THEN NULL" +
		" WHEN set_config('lock_timeout', '0', true) IS NULL THEN true ELSE true END"
}

// PgBound is the SQL expression that sets the server-enforced bound of a turn's
// session, ms (a parameter, text, milliseconds), if the session is the client's own
// (pid, as for PgEnter): the server ends the session if it stays idle
// (idle_session_timeout) or its client stops acknowledging (tcp_user_timeout) for
// longer, which frees the line lock. PgRelease puts them back.
func PgBound(ms, pid string) string {
	return "CASE WHEN pg_backend_pid() = " + pid + " THEN set_config('idle_session_timeout', " + ms + ", false) || " +
		"set_config('tcp_user_timeout', " + ms + ", false) END"
}

// PgPID is the backend pid of conn's session as pgx received it when it connected
// (0 with another driver: the line is then not used), for PgEnter and PgBound.
func PgPID(conn *sql.Conn) int64 {
	if pc := interrupt.PgConn(conn); pc != nil {
		return int64(pc.PID())
	}
	return 0
}

// PgRelease is the SQL select-list fragment, for the end of a release statement run
// on a turn's session, that gives back the line lock of advisory key k (a PgLineKey
// expression) and puts the session's bound back: two boolean columns, unlocked (the
// session held it) and in_line (another session took it at once), then the reset
// settings.
func PgRelease(k string) string {
	return "pg_advisory_unlock(" + k + ") AS unlocked, NOT pg_try_advisory_xact_lock_shared(" + k + ") AS in_line, " +
		pgReset + " AS reset"
}

// pgReset puts a turn's session bound (PgBound) back: a NULL value is a RESET.
const pgReset = "set_config('idle_session_timeout', NULL, false) || set_config('tcp_user_timeout', NULL, false)"

// MyEnter is the MySQL derived table that enters the line of name (MyName): it has
// one row when the session holds the line lock, and none when the wait ran out. A
// derived table without a table is materialised before the statement reads any
// table, so no row lock is held while it waits. MySQL 9.7 and MariaDB 10.11 evaluate
// it twice when it has a row (GET_LOCK then counts two holds of the session), and
// the second evaluation finds the lock already held: whether the first one waited is
// lost, so Result.Waited is not reported on MySQL, and the line lock is given back
// with RELEASE_ALL_LOCKS(): a turn's session holds no other.
func MyEnter(name string, wait time.Duration) string {
	secs := strconv.FormatFloat(wait.Seconds(), 'f', 3, 64)
	return "(SELECT w.waited FROM (SELECT IF(GET_LOCK(" + name + ", 0) = 1, 0, IF(GET_LOCK(" + name + ", " + secs +
		") = 1, 1, NULL)) AS waited) w WHERE w.waited IS NOT NULL)"
}

// MyRelease is the SQL expression, for a release statement run on a turn's session
// (evaluated once, on the released row, after it is locked), that gives the line lock
// back and evaluates to 4 + 2*unlocked + in_line: unlocked, the session held it;
// in_line, another session took it at once.
func (ln *Line) MyRelease(keySQL string) string {
	return "4 + 2 * (RELEASE_ALL_LOCKS() > 0) + (IS_USED_LOCK(" + ln.MyName(keySQL) + ") IS NOT NULL)"
}

// MyReleased decodes MyRelease's value: ok is false for a value out of its range.
func MyReleased(v int64) (unlocked, inLine, ok bool) {
	if v < 4 || v > 7 {
		return false, false, false
	}
	return v&2 != 0, v&1 != 0, true
}

// unlockSQL is the statement that gives the line lock of key $1 back on its own (and,
// on PostgreSQL, puts the session's bound back, as PgRelease does).
func (ln *Line) unlockSQL() string {
	if ln.dialect == sqllock.Postgres {
		return "SELECT pg_advisory_unlock(" + ln.PgKey("$1") + "), " + pgReset
	}
	return "DO RELEASE_ALL_LOCKS()"
}

func (ln *Line) unlockArgs(key []byte) []any {
	if ln.dialect == sqllock.Postgres {
		return []any{key}
	}
	return nil
}

// Off turns the Locker's line off for good, logging why once: its session locks do
// not stay with their sessions (a transaction-pooling proxy).
func (ln *Line) Off(why string) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if !ln.off {
		ln.off = true
		ln.log.Warn("sqllock/"+ln.space+": the server-side line is off: "+why+
			" (a pooler such as pgbouncer?); contended acquisitions wait without it", "strategy", ln.space)
	}
}
