package advisory

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/pin"
)

// pgStatements holds the SQL of one PostgreSQL mode (exclusive or shared) and key form
// (two int4, or one bigint).
type pgStatements struct {
	try, wait, unlock, xact, tryXact string
}

// pgStatementsFor builds the statements of a Locker whose sessions are bounded by
// ttl. A granted session lock also sets the session's bound in the same statement
// (idle_session_timeout: the server ends a session idle for longer; tcp_user_timeout:
// and one whose client stopped acknowledging), and the unlock puts them back: no
// round trip is added to the bare lock statements, whether the session is fresh from
// the pool or not. With token, the locking statements also draw the fencing token
// (fence.EpochPostgres), evaluated once the lock is held: no round trip and no
// commit of its own.
func pgStatementsFor(ttl time.Duration, token bool) (t [2][2]pgStatements) {
	ms := "'" + pin.Millis(ttl) + "'"
	setIdle := "set_config('idle_session_timeout', " + ms + ", false)"
	setTCP := "set_config('tcp_user_timeout', " + ms + ", false)"
	// set_config with a NULL value is a RESET: the session's default comes back (a
	// lookup in pg_settings instead costs half a millisecond each).
	reset := "set_config('idle_session_timeout', NULL, false), set_config('tcp_user_timeout', NULL, false)"
	tok, tokIfGot := "", ""
	if token {
		tok = ", " + fence.EpochPostgres
		tokIfGot = ", CASE WHEN l.got THEN " + fence.EpochPostgres + " END"
	}
	for sh := 0; sh < 2; sh++ {
		for raw := 0; raw < 2; raw++ {
			suffix := ""
			if sh == 1 {
				suffix = "_shared"
			}
			args, stampArg := "($1::int4, $2::int4)", "$3::text"
			if raw == 1 {
				args, stampArg = "($1::int8)", "$2::text"
			}
			// The session's stamp is read before this statement writes its own (see
			// pooler.go): left to right in one select list.
			// The stamp is written only where it differs (a first lock on the session):
			// set_config costs more than the read.
			stamp := "current_setting('sqllock.session', true), CASE WHEN current_setting('sqllock.session', true) IS DISTINCT FROM " +
				stampArg + " THEN set_config('sqllock.session', " + stampArg + ", false) END"
			t[sh][raw] = pgStatements{
				// The lock function runs in a subquery, once, before the settings and
				// the token. The settings' values are not read back.
				try: "SELECT l.got, pg_backend_pid(), " + stamp + ", CASE WHEN l.got THEN " + setIdle + " || " + setTCP + " END" + tokIfGot +
					" FROM (SELECT pg_try_advisory_lock" + suffix + args + " AS got) l",
				wait: "SELECT pg_backend_pid(), " + stamp + ", " + setIdle + " || " + setTCP + tok + " FROM pg_advisory_lock" + suffix + args,
				// One row if the lock was held (the caller reads the row count: Exec
				// starts no goroutine of database/sql's, unlike a query with a context).
				unlock:  "SELECT 1 FROM (SELECT pg_advisory_unlock" + suffix + args + " AS ok, " + reset + ") s WHERE s.ok",
				xact:    "SELECT 1" + tok + " FROM pg_advisory_xact_lock" + suffix + args,
				tryXact: "SELECT l.got" + tokIfGot + " FROM (SELECT pg_try_advisory_xact_lock" + suffix + args + " AS got) l",
			}
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

// pgLock takes the lock on conn and, with tokens, draws the token. dirty reports
// that the session must be discarded.
func (l *Locker) pgLock(ctx context.Context, conn *sql.Conn, id lockID, wait bool) (sid, tok int64, ok, dirty bool, err error) {
	st := l.pgStmts(id)
	var t sql.NullInt64
	var set, prev, stampSet sql.NullString // the settings, not read; the session's stamp before
	stamp := sessionStamp(conn)
	args := append(id.pgArgs(), stamp)
	if !wait {
		err = conn.QueryRowContext(ctx, st.try, args...).Scan(l.withToken(&t, &ok, &sid, &prev, &stampSet, &set)...)
		dirty = err != nil
	} else {
		// A wait that ctx ends is cancelled on the server (see internal/interrupt):
		// with pgx by cancel requests; with another driver the connection is broken.
		// After an error the session is discarded, so that a lock granted at that
		// instant dies with it.
		dirty, err = l.interrupter().Run(ctx, interrupt.Target{PgConn: interrupt.PgConn(conn), Label: id.name}, false,
			func(qctx context.Context) error {
				return conn.QueryRowContext(qctx, st.wait, args...).Scan(l.withToken(&t, &sid, &prev, &stampSet, &set)...)
			})
		ok, dirty = err == nil, dirty || err != nil
	}
	if err == nil && foreignStamp(stamp, prev) {
		// Another client's session: whatever was taken here is not ours to keep.
		refusal := l.poolerSeen(fmt.Sprintf("backend %d carries another client connection's session", sid))
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
// whether the unlock ran there and released it (behind a pooler it may run on
// another backend). Bounded by lease.GiveBackTimeout whatever ctx says.
func (l *Locker) unlockOn(ctx context.Context, conn *sql.Conn, id lockID, sid int64) bool {
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lease.GiveBackTimeout)
	defer cancel()
	var pid int64
	err := conn.QueryRowContext(gctx, "SELECT pg_backend_pid() FROM ("+l.pgStmts(id).unlock+") u", id.pgArgs()...).Scan(&pid)
	return err == nil && pid == sid
}

func (l *Locker) interrupter() interrupt.Interrupter {
	return interrupt.Interrupter{DB: l.db, Logger: l.cfg.Logger}
}

// noDeadlineWait is the GET_LOCK timeout used when ctx has no deadline; the wait is
// repeated after it. MariaDB rejects negative (infinite) timeouts.
const noDeadlineWait = 365 * 24 * time.Hour

// myLock takes the lock on conn with GET_LOCK. The name is hex and the timeout a
// number formatted here, so each statement is sent as text with no parameters: one
// round trip. The first attempt does not wait and also reads the session id; an
// uncontended acquisition is that one statement.
func (l *Locker) myLock(ctx context.Context, conn *sql.Conn, id lockID, wait bool) (sid int64, ok, dirty bool, err error) {
	var got sql.NullInt64
	err = conn.QueryRowContext(ctx, "SELECT GET_LOCK('"+id.myName+"', 0), CONNECTION_ID()").Scan(&got, &sid)
	switch {
	case err != nil:
		return 0, false, true, err
	case !got.Valid:
		return 0, false, true, errors.New("GET_LOCK returned NULL")
	case got.Int64 == 1:
		return sid, true, false, nil
	case !wait:
		return 0, false, false, nil
	}
	for {
		timeout := noDeadlineWait
		if dl, has := ctx.Deadline(); has {
			timeout = max(time.Until(dl), 0)
		}
		q := "SELECT GET_LOCK('" + id.myName + "', " + strconv.FormatFloat(timeout.Seconds(), 'f', 6, 64) + ")"
		got, interrupted, broken, err := l.myWait(ctx, conn, sid, q)
		switch {
		case broken:
			return 0, false, true, err
		case err == nil && got.Valid && got.Int64 == 1:
			if !interrupted {
				return sid, true, false, nil
			}
			// Granted as ctx ended: give it back on this session, synchronously, so
			// that nobody finds it held afterwards.
			var rel sql.NullInt64
			if rerr := conn.QueryRowContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK('"+id.myName+"')").Scan(&rel); rerr != nil {
				return 0, false, true, nil
			}
			return 0, false, false, nil
		case interrupted || ctx.Err() != nil:
			// KILL QUERY ended the wait (an error or NULL): the session is clean.
			return 0, false, false, nil
		case err != nil:
			return 0, false, true, err
		}
		if dl, has := ctx.Deadline(); has && time.Until(dl) < time.Millisecond {
			<-ctx.Done()
			return 0, false, false, nil
		}
		// The server's timer ended just before ctx's deadline, or a year passed: wait
		// again for what is left.
	}
}

// myWait runs the blocking GET_LOCK q on conn (session sid). A thread blocked in
// GET_LOCK does not notice a closed socket: it would stay queued, may be granted the
// lock, and hold it until it notices (about a second, seen on MariaDB 10.11). So when
// ctx ends the wait is interrupted with KILL QUERY from another pooled connection
// (see internal/interrupt), and the session stays usable; broken reports that no
// connection was free and the waiter's connection was closed instead.
func (l *Locker) myWait(ctx context.Context, conn *sql.Conn, sid int64, q string) (got sql.NullInt64, interrupted, broken bool, err error) {
	kill := "KILL QUERY " + strconv.FormatInt(sid, 10)
	broken, err = l.interrupter().Run(ctx, interrupt.Target{
		Kill: func(kctx context.Context, kc *sql.Conn) error {
			_, err := kc.ExecContext(kctx, kill)
			return err
		},
		Label: q,
	}, false, func(qctx context.Context) error {
		return conn.QueryRowContext(qctx, q).Scan(&got)
	})
	return got, ctx.Err() != nil, broken, err
}
