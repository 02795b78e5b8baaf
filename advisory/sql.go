package advisory

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock/internal/direct"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// pgStatements holds the SQL of one PostgreSQL mode (exclusive or shared) and key form
// (two int4, or one bigint).
type pgStatements struct {
	// try and wait take the lock on a session new from the pool, and set its bound
	// ([fresh]), or on a session the Locker kept with its bound still set ([kept]).
	try, wait [2]string
	// unlock releases the lock and puts the bound back ([fresh]), or leaves it on a
	// session the Locker keeps ([kept]).
	unlock        [2]string
	xact, tryXact string
}

// Indexes of pgStatements' pairs.
const (
	fresh = 0
	kept  = 1
)

// pgReset puts a session's bound back: set_config with a NULL value is a RESET, the
// session's default comes back (a lookup in pg_settings instead costs half a
// millisecond each). The unlock statement of a session the Locker does not keep
// does it; pin.Pool runs it for the sessions it kept (pin.NewKeeping).
const pgReset = "set_config('idle_session_timeout', NULL, false), set_config('tcp_user_timeout', NULL, false)"

// pgStatementsFor builds the statements of a Locker whose sessions are bounded by
// ttl. A granted session lock also sets the session's bound in the same statement
// (idle_session_timeout: the server ends a session idle for longer; tcp_user_timeout:
// and one whose client stopped acknowledging), and the unlock puts them back: no
// round trip is added to the bare lock statements, whether the session is fresh from
// the pool or not. A Locker that takes locks back to back keeps its sessions for a
// moment with the bound left on them (pin.NewKeeping, Reserve): their lock and
// unlock statements leave the settings alone (each set_config costs the server
// microseconds, tcp_user_timeout a system call). With token, the locking statements
// also draw the fencing token (fence.EpochPostgres), evaluated once the lock is held:
// no round trip and no commit of its own.
func pgStatementsFor(ttl time.Duration, token bool) (t [2][2]pgStatements) {
	ms := "'" + pin.Millis(ttl) + "'"
	bound := "set_config('idle_session_timeout', " + ms + ", false) || set_config('tcp_user_timeout', " + ms + ", false)"
	tok, tokIfGot := "", ""
	if token {
		tok = ", " + fence.EpochPostgres + " AS tok"
		tokIfGot = ", CASE WHEN l.got THEN " + fence.EpochPostgres + " END AS tok"
	}
	for sh := 0; sh < 2; sh++ {
		for raw := 0; raw < 2; raw++ {
			suffix := ""
			if sh == 1 {
				suffix = "_shared"
			}
			args, stampArg, sidArg := "($1::int4, $2::int4)", "$3::text", "$3"
			if raw == 1 {
				args, stampArg, sidArg = "($1::int8)", "$2::text", "$2"
			}
			// The session's stamp is read before this statement writes its own (see
			// pooler.go): left to right in one select list.
			// The stamp is written only where it differs (a first lock on the session):
			// set_config costs more than the read.
			stamp := "current_setting('sqllock.session', true) AS prev, CASE WHEN current_setting('sqllock.session', true) IS DISTINCT FROM " +
				stampArg + " THEN set_config('sqllock.session', " + stampArg + ", false) END AS stamped"
			// The outer select returns only what the Locker reads: the settings'
			// values are not read back. The inner select's volatile expressions are
			// evaluated all the same (the planner keeps unused volatile outputs of a
			// subquery, and does not pull such a subquery up).
			outTok := ""
			if token {
				outTok = ", tok"
			}
			st := &t[sh][raw]
			for k, set := range [2]string{fresh: bound, kept: ""} {
				setCol, trySetCol := "", ""
				if set != "" {
					setCol = ", " + set + " AS bound"
					trySetCol = ", CASE WHEN l.got THEN " + set + " END AS bound"
				}
				// The lock function runs in a subquery, once, before the settings and
				// the token.
				st.try[k] = "SELECT got, pid, prev" + outTok + " FROM (SELECT l.got, pg_backend_pid() AS pid, " + stamp + trySetCol + tokIfGot +
					" FROM (SELECT pg_try_advisory_lock" + suffix + args + " AS got) l) s"
				st.wait[k] = "SELECT pid, prev" + outTok + " FROM (SELECT pg_backend_pid() AS pid, " + stamp + setCol + tok +
					" FROM pg_advisory_lock" + suffix + args + ") s"
			}
			// The unlock is meant for the backend that took the lock (the last
			// argument): it returns whether the lock was held there, NULL if it ran on
			// another backend, where it touches nothing (behind a transaction-pooling
			// proxy, another client's session: an unlock there could end that
			// client's shared or re-entered hold), and the backend it ran on. Only the
			// same statement can tell where it ran (run directly: package direct).
			on := "CASE WHEN pg_backend_pid() = " + sidArg + "::int4 THEN "
			st.unlock[fresh] = "SELECT " + on + "(SELECT s.ok FROM (SELECT pg_advisory_unlock" + suffix + args + " AS ok, " + pgReset + ") s) END, pg_backend_pid()"
			st.unlock[kept] = "SELECT " + on + "pg_advisory_unlock" + suffix + args + " END, pg_backend_pid()"
			st.xact = "SELECT 1" + tok + " FROM pg_advisory_xact_lock" + suffix + args
			st.tryXact = "SELECT l.got" + tokIfGot + " FROM (SELECT pg_try_advisory_xact_lock" + suffix + args + " AS got) l"
		}
	}
	return t
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// withToken returns the scan destinations of a locking statement: dest, and t for
// the token its statements draw when the Locker makes tokens.
func (l *Locker) withToken(t *sql.NullInt64, dest ...any) []any {
	if l.cfg.token {
		return append(dest, t)
	}
	return dest
}

func (l *Locker) pgStmts(id lockID) *pgStatements { return &l.pgSQL[b2i(l.shared)][b2i(id.raw)] }

// pgLock takes the lock on conn and, with tokens, draws the token. keptSid is the
// backend of a session the Locker kept with its bound set (pin.NewKeeping), 0 for a
// session new from the pool. dirty reports that the session must be discarded.
func (l *Locker) pgLock(ctx context.Context, conn *sql.Conn, keptSid int64, id lockID, wait bool) (sid, tok int64, ok, dirty bool, err error) {
	st := l.pgStmts(id)
	k := fresh
	if keptSid != 0 {
		k = kept
	}
	var t sql.NullInt64
	var prev sql.NullString // the session's stamp before
	stamp := sessionStamp(conn)
	args := append(id.pgArgs(), stamp)
	if !wait {
		err = direct.Row(ctx, conn, st.try[k], args, l.withToken(&t, &ok, &sid, &prev)...)
		dirty = err != nil
	} else {
		// A wait that ctx ends is cancelled on the server (see internal/interrupt):
		// with pgx by cancel requests; with another driver the connection is broken.
		// After an error the session is discarded, so that a lock granted at that
		// instant dies with it.
		dirty, err = l.interrupter().Run(ctx, interrupt.Target{PgConn: interrupt.PgConn(conn), Label: id.name}, false,
			func(qctx context.Context) error {
				return direct.Row(qctx, conn, st.wait[k], args, l.withToken(&t, &sid, &prev)...)
			})
		ok, dirty = err == nil, dirty || err != nil
	}
	moved := ""
	switch {
	case err != nil:
	case foreignStamp(stamp, prev):
		moved = fmt.Sprintf("backend %d carries another client connection's session", sid)
	case keptSid != 0 && sid != keptSid:
		moved = fmt.Sprintf("the session kept on backend %d now runs on backend %d", keptSid, sid)
	}
	if moved != "" {
		// Another client's session, or one without our bound: whatever was taken here
		// is not ours to keep.
		refusal := l.poolerSeen(moved)
		if ok && !l.unlockOn(ctx, conn, id, sid) {
			l.freeBackend(ctx, sid)
		}
		return sid, 0, false, true, refusal
	}
	if ok && l.cfg.token {
		if tok, err = fence.Drawn(ctx, t, conn, l.db); err != nil {
			return sid, 0, false, true, fmt.Errorf("fencing token: %w", err)
		}
	}
	return sid, tok, ok, dirty, err
}

// unlockOn gives back the lock just taken on backend sid through conn, and reports
// whether nothing more is to be done: the unlock ran there and released it, or it ran
// on another backend (a transaction-pooling proxy), and then the Locker refuses from
// now on and backend sid is being freed (leftBehind). Bounded by
// lease.GiveBackTimeout whatever ctx says.
func (l *Locker) unlockOn(ctx context.Context, conn *sql.Conn, id lockID, sid int64) bool {
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lease.GiveBackTimeout)
	defer cancel()
	held, ranOn, err := l.pgUnlock(gctx, conn, id, sid, fresh)
	if err == nil && l.leftBehind(ctx, sid, ranOn, "the unlock of the lock just taken") != nil {
		return true
	}
	return err == nil && held
}

// pgUnlock runs the unlock statement k (fresh or kept) of id on conn, meant for
// backend sid: it reports whether the lock was held there and released, and the
// backend it ran on (pgRow).
func (l *Locker) pgUnlock(ctx context.Context, conn *sql.Conn, id lockID, sid int64, k int) (held bool, ranOn int64, err error) {
	var ok sql.NullBool
	err = pgRow(ctx, conn, l.pgStmts(id).unlock[k], append(id.pgArgs(), sid), &ok, &ranOn)
	return ok.Valid && ok.Bool, ranOn, err
}

// pgRow is direct.Row for a statement meant for the backend that holds a lock: one
// that pgx's cache prepared and that is missing on the server session, or exists
// there already (42P05, 26000: a transaction-pooling proxy, or DEALLOCATE on the
// session), did not run, and runs again by the simple protocol, so that it can say
// which backend it ran on.
func pgRow(ctx context.Context, conn *sql.Conn, query string, args []any, dest ...any) error {
	err := direct.Row(ctx, conn, query, args, dest...)
	if sqlerr.PooledStatement(err) {
		err = direct.Unprepared(ctx, conn, query, args, dest...)
	}
	return err
}

func (l *Locker) interrupter() interrupt.Interrupter {
	return interrupt.Interrupter{DB: l.db, Logger: l.cfg.Logger}
}

// noDeadlineWait is the GET_LOCK timeout used when ctx has no deadline; the wait is
// repeated after it. MariaDB rejects negative (infinite) timeouts.
const noDeadlineWait = 365 * 24 * time.Hour

// contendedFor is how long after a Locker saw a MySQL lock name held by another
// session its blocking acquisitions of the name skip the attempt that does not wait
// (see myLock).
const contendedFor = time.Second

// contention remembers, per slot of lock names (a few names share a slot), when a
// Locker last saw a name held by another session. A heuristic only: a wrong guess
// costs a statement, never correctness.
type contention [256]atomic.Int64

func contentionSlot(id lockID) int {
	n := id.myName
	b, _ := strconv.ParseUint(n[len(n)-2:], 16, 8) // hex digits of SHA-256
	return int(b)
}

func (l *Locker) contended(id lockID) bool {
	seen := l.st.contention[contentionSlot(id)].Load()
	return seen != 0 && time.Since(time.Unix(0, seen)) < contendedFor
}

func (l *Locker) sawContention(id lockID) {
	l.st.contention[contentionSlot(id)].Store(time.Now().UnixNano())
}

// myLock takes the lock on conn with GET_LOCK and, with tokens, draws the token
// (fence.MySQLRun: no commit). sid is the session's CONNECTION_ID() if a lease of
// this Locker used the session before (pin.Pool keeps it), else 0; the session id is
// returned. sent is when the last statement before the lease starts was sent. The
// name is hex and the timeout a number formatted here, so each statement is sent as
// text with no parameters (one round trip), or, without a token on a session the
// Locker reuses, prepared (myRow).
//
// Statements per acquisition, the release not counted:
//   - a session whose id is known (the usual case: the Locker keeps sessions for
//     reuse): one when the lock is free (GET_LOCK(name, 0), with a token inside the
//     SELECT that draws it, fence.MySQLRun.TryLockDraw); when it is held, the waiting GET_LOCK, and with a token
//     the draw after it. A blocking Acquire of a name that the Locker saw held
//     within contendedFor waits at once; otherwise a held lock costs the failed
//     attempt too.
//   - a session new from the pool: its bound is set first (pin.Pool), then
//     GET_LOCK(name, 0) also reads CONNECTION_ID(), which KILL QUERY needs to end a
//     wait; the token is drawn by a statement of its own.
func (l *Locker) myLock(ctx context.Context, conn *sql.Conn, sid int64, id lockID, wait bool) (_ int64, tok int64, sent time.Time, ok, dirty bool, err error) {
	token := l.cfg.token
	name := "'" + id.myName + "'"
	if !wait || sid == 0 || !l.contended(id) {
		sent = time.Now()
		if sid != 0 && token {
			tok, ok, err = l.myRun.Drawn(ctx, conn, l.myRun.TryLockDraw("GET_LOCK("+name+", 0)"))
		} else {
			var got sql.NullInt64
			err = l.myRow(ctx, conn, "SELECT GET_LOCK(?, 0), CONNECTION_ID()", id.myName, &got, &sid)
			if err == nil && !got.Valid {
				err = errors.New("GET_LOCK returned NULL")
			}
			ok = got.Int64 == 1
			if err == nil && ok && token {
				sent = time.Now()
				tok, _, err = l.myRun.Drawn(ctx, conn, l.myDraw)
			}
		}
		switch {
		case err != nil:
			// The lock may have been taken: the session goes with it.
			return sid, 0, sent, false, true, err
		case ok || !wait:
			return sid, tok, sent, ok, false, nil
		}
		l.sawContention(id)
	}
	sent = time.Now()
	if ok, dirty, err = l.myWait(ctx, conn, sid, id); err != nil || !ok {
		return sid, 0, sent, false, dirty, err
	}
	if token {
		sent = time.Now()
		if tok, _, err = l.myRun.Drawn(ctx, conn, l.myDraw); err != nil {
			return sid, 0, sent, false, true, err
		}
	}
	return sid, tok, sent, true, false, nil
}

// myRow runs query, whose one parameter (?) is a lock name, on conn and scans its
// row into dest: prepared if the Locker's pin.Pool keeps conn's session for reuse
// (pin.Pool.Stmt), else as text with the name inlined (one round trip; a MySQL lock
// name is "sqllock:" and hex digits); either way through the driver connection
// (package direct).
func (l *Locker) myRow(ctx context.Context, conn *sql.Conn, query, myName string, dest ...any) error {
	if st := l.pins.Stmt(ctx, conn, query); st != nil {
		return st.Row(ctx, conn, []any{myName}, dest...)
	}
	return direct.Row(ctx, conn, strings.Replace(query, "?", "'"+myName+"'", 1), nil, dest...)
}

// myWait waits on session sid (conn) until it holds the lock or ctx ends. The
// statement also reads IS_FREE_LOCK first, so that the Locker learns whether the name
// is contended (see myLock).
func (l *Locker) myWait(ctx context.Context, conn *sql.Conn, sid int64, id lockID) (ok, dirty bool, err error) {
	name := "'" + id.myName + "'"
	for {
		timeout := noDeadlineWait
		if dl, has := ctx.Deadline(); has {
			timeout = max(time.Until(dl), 0)
		}
		// Left to right: whether the lock was free before this session asked.
		q := "SELECT IS_FREE_LOCK(" + name + "), GET_LOCK(" + name + ", " + strconv.FormatFloat(timeout.Seconds(), 'f', 6, 64) + ")"
		got, free, interrupted, broken, err := l.myWaitOnce(ctx, conn, sid, q)
		if free.Valid && free.Int64 == 0 {
			l.sawContention(id)
		}
		switch {
		case broken:
			return false, true, err
		case err == nil && got.Valid && got.Int64 == 1:
			if !interrupted {
				return true, false, nil
			}
			// Granted as ctx ended: give it back on this session, synchronously, so
			// that nobody finds it held afterwards.
			var rel sql.NullInt64
			if rerr := conn.QueryRowContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK("+name+")").Scan(&rel); rerr != nil {
				return false, true, nil
			}
			return false, false, nil
		case interrupted || ctx.Err() != nil:
			// KILL QUERY ended the wait (an error or NULL): the session is clean.
			return false, false, nil
		case err != nil:
			return false, true, err
		}
		if interrupt.TooLate(ctx) {
			return false, false, nil
		}
		// The server's timer ended just before ctx's deadline, or a year passed: wait
		// again for what is left.
	}
}

// myWaitOnce runs the blocking GET_LOCK q on conn (session sid). A thread blocked in
// GET_LOCK does not notice a closed socket: it would stay queued, may be granted the
// lock, and hold it until it notices (about a second, seen on MariaDB 10.11). So when
// ctx ends the wait is interrupted with KILL QUERY from another pooled connection
// (see internal/interrupt), and the session stays usable; broken reports that no
// connection was free and the waiter's connection was closed instead.
func (l *Locker) myWaitOnce(ctx context.Context, conn *sql.Conn, sid int64, q string) (got, free sql.NullInt64, interrupted, broken bool, err error) {
	broken, err = l.interrupter().Run(ctx, interrupt.Target{Kill: interrupt.KillQuery(sid), Label: q}, false, func(qctx context.Context) error {
		return conn.QueryRowContext(qctx, q).Scan(&free, &got)
	})
	return got, free, ctx.Err() != nil, broken, err
}
