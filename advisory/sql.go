package advisory

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strconv"
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

// myLock takes the lock on conn with GET_LOCK. The name is hex and the timeout a
// number formatted here, so the statement is sent as text with no parameters: one
// round trip.
func (l *Locker) myLock(ctx context.Context, conn *sql.Conn, id lockID, wait bool) (sid int64, ok, dirty bool, err error) {
	for {
		timeout := time.Duration(0)
		if wait {
			timeout = noDeadlineWait
			if dl, has := ctx.Deadline(); has {
				timeout = max(time.Until(dl), 0)
			}
		}
		q := "SELECT GET_LOCK('" + id.myName + "', " + strconv.FormatFloat(timeout.Seconds(), 'f', 6, 64) + "), CONNECTION_ID()"
		var got sql.NullInt64
		// go-sql-driver closes the connection if ctx ends during GET_LOCK; the server
		// notices the closed socket within about a second and never grants the lock to
		// the dead session (verified on MariaDB 10.11).
		err = conn.QueryRowContext(ctx, q).Scan(&got, &sid)
		switch {
		case err != nil:
			return 0, false, true, err
		case !got.Valid:
			return 0, false, true, errors.New("GET_LOCK returned NULL")
		case got.Int64 == 1:
			return sid, true, false, nil
		}
		if !wait || ctx.Err() != nil {
			return 0, false, false, nil
		}
		if dl, has := ctx.Deadline(); has && time.Until(dl) < time.Millisecond {
			<-ctx.Done()
			return 0, false, false, nil
		}
		// The server's timer ended just before ctx's deadline, or a year passed: wait
		// again for what is left.
	}
}
