// Package interrupt runs statements that may wait on the server for a lock, and ends
// such a wait on the server when the caller's context ends.
//
// Drivers end a statement whose context ended by closing its connection, and a
// server session blocked on a lock does not notice a closed connection: it stays
// queued, may be granted the lock, and holds it until it notices. So the statement
// runs on a context of its own, and when the caller's context ends the wait is
// interrupted out of band: PostgreSQL cancel requests (pgx), or a statement such as
// KILL QUERY from another pooled connection. Only if that fails is the waiter's
// connection broken, and the session must then be discarded.
package interrupt

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Grace bounds how long interrupts are tried after the caller's context ended before
// the waiting statement's connection is broken instead.
const Grace = time.Second

// ServerBoundGrace is how long after a deadline a statement that has a server-side
// timeout of its own ending at that deadline is given before it is interrupted.
const ServerBoundGrace = 200 * time.Millisecond

// PoolWait bounds the wait for a pooled connection to interrupt from.
const PoolWait = 100 * time.Millisecond

// TooLate reports whether ctx's deadline is less than a millisecond away (the
// smallest server-side bound of a wait), and then returns only once ctx has ended: a
// statement that would wait on the server is not started, and the caller reports
// ctx's end as that of any other wait.
func TooLate(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	if !ok || time.Until(dl) >= time.Millisecond {
		return false
	}
	<-ctx.Done()
	return true
}

// Target is the session of a waiting statement.
type Target struct {
	// PgConn is the session's pgx connection, if the driver is pgx: the wait is then
	// ended by cancel requests, which need no pooled connection.
	PgConn *pgconn.PgConn
	// Kill interrupts the statement from conn, another session (KILL QUERY,
	// pg_cancel_backend). It is used when PgConn is nil; without it, the waiter's
	// connection is broken.
	Kill func(ctx context.Context, conn *sql.Conn) error
	// Label names the target in logs.
	Label string
}

// KillQuery is the Kill of a MySQL session sid: KILL QUERY from another session (KILL
// takes no placeholder: the id is formatted in).
func KillQuery(sid int64) func(ctx context.Context, conn *sql.Conn) error {
	kill := "KILL QUERY " + strconv.FormatInt(sid, 10)
	return func(ctx context.Context, conn *sql.Conn) error {
		_, err := conn.ExecContext(ctx, kill)
		return err
	}
}

// Interrupter interrupts waits from the connections of DB.
type Interrupter struct {
	DB     *sql.DB
	Logger *slog.Logger
}

// Run runs stmt with a context that does not end with ctx, and interrupts it when
// ctx ends first. serverBound tells that stmt has a server-side timeout of its own
// ending at ctx's deadline: a deadline then interrupts only as a backstop. dirty
// reports that the session must be discarded: its connection was broken, or an
// interrupt whose delivery is uncertain may still reach a later statement. Run
// returns only when no interrupt of this statement is under way, so the session may
// run its next statement at once.
//
// Nothing runs beside a statement whose ctx does not end (context.AfterFunc starts
// the interrupter only then). With pgx (t.PgConn) the statement's context cannot end
// at all, so neither database/sql nor pgx watches it; the last resort of breaking the
// connection sets its deadline, as pgx does for a cancelled context. With other
// drivers the statement's context is cancelled instead.
func (in Interrupter) Run(ctx context.Context, t Target, serverBound bool, stmt func(qctx context.Context) error) (dirty bool, err error) {
	if ctx.Done() == nil {
		return false, stmt(ctx)
	}
	qctx := context.WithoutCancel(ctx)
	var breakConn func()
	if t.PgConn != nil {
		breakConn = func() { _ = t.PgConn.Conn().SetDeadline(time.Now()) }
	} else {
		var cancel context.CancelFunc
		qctx, cancel = context.WithCancel(qctx)
		defer cancel()
		breakConn = cancel
	}
	finished := make(chan struct{})
	exited := make(chan struct{})
	clean := true
	stop := context.AfterFunc(ctx, func() {
		defer close(exited)
		if serverBound && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			tm := time.NewTimer(ServerBoundGrace)
			defer tm.Stop()
			select {
			case <-finished:
				return
			case <-tm.C:
			}
		}
		select {
		case <-finished:
			return
		default:
		}
		clean = in.interrupt(t, finished, breakConn)
	})
	err = stmt(qctx)
	// No other statement may start on the session while an interrupt of this one is
	// on its way: wait for the interrupter. An interrupt that arrives between
	// statements is ignored by both servers.
	close(finished)
	if !stop() {
		<-exited
	}
	return !clean, err
}

// interrupt ends t's waiting statement and reports whether the session is clean once
// finished is closed. If the statement has not returned within Grace, or nothing
// could be sent, the waiter's connection is broken.
func (in Interrupter) interrupt(t Target, finished <-chan struct{}, breakConn func()) bool {
	until := time.Now().Add(Grace)
	var clean bool
	if t.PgConn != nil {
		clean = in.cancelRequests(t, finished, until)
	} else {
		clean = in.fromPool(t, finished, until)
	}
	if !clean {
		breakConn()
	}
	return clean
}

// cancelRequests sends PostgreSQL cancel requests until finished is closed or until.
// It reports whether finished was closed with every request acknowledged by the
// server (so none can reach a later statement).
func (in Interrupter) cancelRequests(t Target, finished <-chan struct{}, until time.Time) bool {
	certain := true
	for pause := 10 * time.Millisecond; time.Now().Before(until); pause = min(2*pause, 200*time.Millisecond) {
		cctx, cancel := context.WithDeadline(context.Background(), until)
		err := t.PgConn.CancelRequest(cctx)
		if err != nil || cctx.Err() != nil {
			// Not sent, or sent without the server's acknowledgement: it may still
			// arrive later.
			certain = false
			in.Logger.Warn("sqllock: cancel request failed", "target", t.Label, "pid", t.PgConn.PID(), "err", err)
		}
		cancel()
		tm := time.NewTimer(min(pause, max(time.Until(until), 0)))
		select {
		case <-finished:
			tm.Stop()
			return certain
		case <-tm.C:
		}
	}
	return false
}

// fromPool runs t.Kill from a pooled connection, if one is free at once, repeating
// until finished is closed or until. It reports whether finished was closed with
// every Kill completed.
func (in Interrupter) fromPool(t Target, finished <-chan struct{}, until time.Time) bool {
	if t.Kill == nil {
		return false
	}
	if st := in.DB.Stats(); st.MaxOpenConnections > 0 && st.Idle == 0 && st.OpenConnections >= st.MaxOpenConnections {
		in.Logger.Warn("sqllock: no free connection to interrupt a lock wait from: breaking its connection", "target", t.Label)
		return false
	}
	cctx, cancel := context.WithDeadline(context.Background(), until)
	defer cancel()
	gctx, gcancel := context.WithTimeout(cctx, PoolWait)
	conn, err := in.DB.Conn(gctx)
	gcancel()
	if err != nil {
		in.Logger.Warn("sqllock: no connection to interrupt a lock wait from: breaking its connection", "target", t.Label, "err", err)
		return false
	}
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, 200*time.Millisecond) {
		if err := t.Kill(cctx, conn); err != nil {
			in.Logger.Warn("sqllock: interrupting a lock wait failed", "target", t.Label, "err", err)
			Release(conn, true)
			return false
		}
		tm := time.NewTimer(pause)
		select {
		case <-finished:
			tm.Stop()
			conn.Close()
			return true
		case <-cctx.Done():
			tm.Stop()
			conn.Close()
			return false
		case <-tm.C:
		}
	}
}

// PgConn returns the pgx connection behind conn, or nil with another driver.
func PgConn(conn *sql.Conn) *pgconn.PgConn {
	var pgc *pgconn.PgConn
	_ = conn.Raw(func(dc any) error {
		if p, ok := dc.(interface{ Conn() *pgx.Conn }); ok && p.Conn() != nil {
			pgc = p.Conn().PgConn()
		}
		return nil
	})
	return pgc
}

// Release returns conn to the pool, or, if discard, closes its session instead: the
// server then drops every lock the session held.
//
// With pgx the connection itself is closed first: under stdlib.OpenDBFromPool,
// database/sql's close of a bad connection only hands it back to the pgxpool, which
// would keep the session (and its locks) for the next user; a closed connection it
// destroys.
func Release(conn *sql.Conn, discard bool) {
	if discard {
		_ = conn.Raw(func(dc any) error {
			if p, ok := dc.(interface{ Conn() *pgx.Conn }); ok && p.Conn() != nil {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				p.Conn().Close(ctx)
				cancel()
			}
			return driver.ErrBadConn
		})
	}
	conn.Close()
}
