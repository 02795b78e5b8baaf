package advisory

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

var errBadConn = driver.ErrBadConn

// pgStatements holds the SQL of one PostgreSQL mode (exclusive or shared) and key form
// (two int4, or one bigint).
type pgStatements struct {
	try, wait, unlock, xact, tryXact string
}

// pgSQL is indexed by [shared][raw].
var pgSQL = func() (t [2][2]pgStatements) {
	for sh := 0; sh < 2; sh++ {
		for raw := 0; raw < 2; raw++ {
			suffix := ""
			if sh == 1 {
				suffix = "_shared"
			}
			args := "($1::int4, $2::int4)"
			if raw == 1 {
				args = "($1::int8)"
			}
			t[sh][raw] = pgStatements{
				try:     "SELECT pg_try_advisory_lock" + suffix + args + ", pg_backend_pid()",
				wait:    "SELECT pg_backend_pid() FROM pg_advisory_lock" + suffix + args,
				unlock:  "SELECT pg_advisory_unlock" + suffix + args,
				xact:    "SELECT 1 FROM pg_advisory_xact_lock" + suffix + args,
				tryXact: "SELECT pg_try_advisory_xact_lock" + suffix + args,
			}
		}
	}
	return t
}()

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (l *Locker) pgStmts(id lockID) *pgStatements { return &pgSQL[b2i(l.shared)][b2i(id.raw)] }

// cancelGrace bounds how long a blocked pg_advisory_lock may take to return after its
// cancel request was sent before its connection is broken instead.
const cancelGrace = time.Second

// pgLock takes the lock on conn. dirty reports that the session must be discarded.
func (l *Locker) pgLock(ctx context.Context, conn *sql.Conn, id lockID, wait bool) (sid int64, ok, dirty bool, err error) {
	st := l.pgStmts(id)
	if !wait {
		var pid int64
		err = conn.QueryRowContext(ctx, st.try, id.pgArgs()...).Scan(&ok, &pid)
		return pid, ok, err != nil, err
	}

	var pgc *pgconn.PgConn
	_ = conn.Raw(func(dc any) error {
		if c, isPgx := dc.(interface{ Conn() *pgx.Conn }); isPgx {
			pgc = c.Conn().PgConn()
		}
		return nil
	})
	if pgc == nil {
		// Another driver: the driver aborts the statement as it sees fit; the session
		// is discarded afterwards, so a lock granted at that instant dies with it.
		err = conn.QueryRowContext(ctx, st.wait, id.pgArgs()...).Scan(&sid)
		return sid, err == nil, err != nil || ctx.Err() != nil, err
	}

	// How pgx ends a statement whose context ended depends on its context watcher
	// handler (set by the user's connection config): a closed socket may not be noticed
	// by a backend blocked on a lock until the lock is granted (PostgreSQL checks idle
	// clients only with client_connection_check_interval, off by default). Do not rely
	// on it: run the statement on a context of our own, send a cancel request when ctx
	// ends, and break the connection only if that fails.
	qctx, qcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer qcancel()
	finished := make(chan struct{})
	sent := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(sent)
		cctx, cancel := context.WithTimeout(context.Background(), cancelGrace)
		defer cancel()
		if pgc.CancelRequest(cctx) == nil {
			select {
			case <-finished:
				return
			case <-cctx.Done():
			}
		}
		qcancel()
	})
	err = conn.QueryRowContext(qctx, st.wait, id.pgArgs()...).Scan(&sid)
	close(finished)
	if !stop() {
		<-sent
		// A cancel request may still be in flight towards this session, and the lock
		// may have been granted: the session cannot be trusted with anything else.
		dirty = true
	}
	return sid, err == nil, dirty || err != nil, err
}

// noDeadlineWait is the GET_LOCK timeout used when ctx has no deadline; the wait is
// repeated after it. MariaDB rejects negative (infinite) timeouts.
const noDeadlineWait = 365 * 24 * time.Hour

// killGrace bounds how long an interrupted GET_LOCK wait may wait for a pooled
// connection to send KILL QUERY from, before the waiter's connection is closed instead.
const killGrace = 200 * time.Millisecond

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

// myWait runs the blocking GET_LOCK q on conn (session sid). go-sql-driver would close
// the connection when ctx ends, and a server thread blocked in GET_LOCK does not
// notice a closed socket: it stays queued, may be granted the lock, and holds it until
// it notices (about a second, seen on MariaDB 10.11). So the statement runs on a
// context of its own, and when ctx ends the wait is interrupted with KILL QUERY from
// another pooled connection; the session stays usable. Only if no connection is free
// within killGrace is the waiter's connection closed (broken).
func (l *Locker) myWait(ctx context.Context, conn *sql.Conn, sid int64, q string) (got sql.NullInt64, interrupted, broken bool, err error) {
	qctx, qcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer qcancel()
	var closed atomic.Bool
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(done)
		kctx, cancel := context.WithTimeout(context.Background(), killGrace)
		defer cancel()
		if _, kerr := l.db.ExecContext(kctx, "KILL QUERY "+strconv.FormatInt(sid, 10)); kerr != nil {
			closed.Store(true)
			qcancel()
		}
	})
	err = conn.QueryRowContext(qctx, q).Scan(&got)
	if !stop() {
		// The interrupt ran or runs: wait for it, so that a late KILL QUERY cannot
		// hit the next statement of this session.
		<-done
		interrupted = true
	}
	return got, interrupted, closed.Load(), err
}
