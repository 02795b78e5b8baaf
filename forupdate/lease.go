package forupdate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// ErrCommitUnknown reports that Release sent COMMIT but cannot tell whether the
// database committed (its context ended, or the connection broke, before the reply),
// or, on MySQL, that its context ended before the check it makes before COMMIT got a
// reply (COMMIT was not sent, but the transaction may have committed early). The lock
// is free either way. Lease.Token tells: the transaction committed if and
// only if Locker.CommittedToken returns the lease's token (with tokens enabled).
var ErrCommitUnknown = errors.New("sqllock/forupdate: commit outcome unknown")

// Lease is a held forupdate lock: an open transaction on one pooled connection that
// holds the row lock of its name. Release commits the transaction, and with it every
// write made through Tx; Rollback discards them. Either frees the lock and returns the
// connection to the pool. Its methods are safe for concurrent use, but Tx, like any
// *sql.Tx, runs one statement at a time.
type Lease struct {
	l       *Locker
	name    string
	key     []byte
	token   int64
	session int64
	since   time.Time // PostgreSQL: the transaction's start (now()); MySQL: the grant
	conn    *sql.Conn
	tx      *sql.Tx
	target  waitTarget
	core    *lease.Lease
	commit  bool // set by Release (true) or Rollback (false) before the core's Release
	// handed is set once the transaction was handed out (Tx, WithLock): only then can
	// a statement of the caller's have ended it early.
	handed atomic.Bool
}

var _ sqllock.Lease = (*Lease)(nil)

func (l *Locker) newLease(name string, key []byte, g grant, conn *sql.Conn, tx *sql.Tx, target waitTarget, granted time.Time) *Lease {
	s := &Lease{
		l: l, name: name, key: key, token: g.token, session: g.sid, since: g.since,
		conn: conn, tx: tx, target: target,
	}
	s.core = lease.Prepare(keeper{s}, lease.Params{
		Timing:  l.cfg.Timing,
		Granted: granted,
		Label:   l.cfg.Label("forupdate", l.dialect, name),
		Log:     l.cfg.Logger,
	})
	s.core.Run()
	return s
}

// Name returns the lock name.
func (s *Lease) Name() string { return s.name }

// Token returns the fencing token, drawn once the row lock was held from a counter
// that rollbacks do not undo: strictly greater than the token of every earlier
// acquisition of the name, including acquisitions that rolled back or were lost. It
// is stored in the lock row and committed by Release together with the work done in
// Tx. It is 0 for a Locker made WithoutToken.
func (s *Lease) Token() int64 { return s.token }

// Tx returns the transaction that holds the lock. Do the protected work through it:
// it commits with Release. Do not call its Commit or Rollback; use the lease's. Do
// not run statements that end the transaction (COMMIT, ROLLBACK, DDL and LOCK TABLES
// on MySQL): they free the lock early, and the lease reports ErrLost.
func (s *Lease) Tx() *sql.Tx {
	s.handed.Store(true)
	return s.tx
}

// SessionID returns the id of the database session holding the lock: the backend
// pid on PostgreSQL (pg_backend_pid()), the connection id on MySQL
// (CONNECTION_ID()). For diagnostics and fault tests.
func (s *Lease) SessionID() int64 { return s.session }

// Done is closed when the lease was released, rolled back or lost. A passed local
// deadline closes it at once, whoever looks first.
func (s *Lease) Done() <-chan struct{} { return s.core.Done() }

// Err returns nil while the lease is held, an error matching sqllock.ErrLost once it
// is lost, and one matching sqllock.ErrNotHeld after Release or Rollback.
func (s *Lease) Err() error { return s.core.Err() }

// Release commits the transaction, and so the work done in Tx together with the new
// token, which frees the lock. On MySQL, if Tx was called, it first checks that the
// transaction is still the lease's (a DDL statement, LOCK TABLES, or InnoDB rolling
// back a deadlock victim ends it early, which frees the lock): if not, it rolls back whatever ran
// since and returns an error matching sqllock.ErrLost, as it does when the lease was
// lost before. A COMMIT that fails with a deadlock or certification failure (a
// Galera cluster) also reports ErrLost; another failure of COMMIT (a deferred
// constraint, a serialization failure) returns an *sqllock.Error carrying it, and
// nothing was committed. If the reply to COMMIT (on MySQL, or to the check before it)
// does not come before ctx ends (or the connection breaks meanwhile) the error matches
// ErrCommitUnknown: the session is ended (which takes up to a second more when the
// database cannot be reached), and whether the work committed is told by the token. Release commits even
// if ctx has ended when it is called (bounded by its own short timeout), because a
// caller whose context ended after its work was done must not lose that work
// silently; to discard the work, call Rollback. Later calls return nil.
func (s *Lease) Release(ctx context.Context) error {
	s.commit = true
	return s.core.Release(ctx)
}

// Rollback rolls the transaction back, discarding the work done in Tx, and frees the
// lock. Like Release it is safe to call more than once, and after Release.
func (s *Lease) Rollback(ctx context.Context) error { return s.core.Release(ctx) }

// keeper is the lease's side of the lease core.
type keeper struct{ s *Lease }

// KeepAlive checks that the lease's transaction is still open on its session, from
// another pooled connection (so that it never interferes with statements the caller
// runs in Tx), and how long the server-enforced bound has left:
//
//   - PostgreSQL: pg_stat_activity shows the session (pid, and a backend_start no
//     later than the transaction, so a reused pid is not taken for it) in the
//     lease's transaction (xact_start). While it runs a statement the bound is not
//     running; while it is idle, the transaction is touched through its own
//     connection if the driver is pgx and nothing of the caller's is under way
//     (which restarts idle_in_transaction_session_timeout), and otherwise the bound
//     left is TTL less the time it has been idle.
//   - MySQL: the processlist shows the session; a Sleep of TIME seconds leaves TTL
//     less that much of wait_timeout (statements of the caller are the only touch:
//     see the package documentation). The server's uptime tells a restart (whose
//     new session ids may reuse the lease's), and a committed token at least the
//     lease's tells a transaction committed early.
func (k keeper) KeepAlive(ctx context.Context) (time.Duration, error) {
	s := k.s
	if s.l.dialect == sqllock.Postgres {
		return s.pgKeepAlive(ctx)
	}
	return s.myKeepAlive(ctx)
}

func (s *Lease) pgKeepAlive(ctx context.Context) (time.Duration, error) {
	var (
		state, waitEvent sql.NullString
		idleUS           int64
	)
	err := s.l.db.QueryRowContext(ctx, pgActivity, s.session, s.since).Scan(&state, &waitEvent, &idleUS)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, lease.Gonef("session %d or its transaction ended", s.session)
	}
	if err != nil {
		return 0, err
	}
	ttl := s.l.cfg.Timing.TTL
	switch {
	case state.String == "active" && waitEvent.String == "ClientWrite":
		// Blocked sending to the client: tcp_user_timeout may be running.
		return 0, errors.New("session is blocked sending to the client")
	case state.String == "active":
		return ttl, nil // the bound runs only while the session is idle
	case state.String == "idle in transaction (aborted)":
		return 0, errAborted
	}
	idle := time.Duration(idleUS) * time.Microsecond
	switch s.touch(ctx) {
	case touched:
		return ttl, nil
	case touchAborted:
		return 0, errAborted
	}
	return ttl - idle, nil
}

// errAborted: on PostgreSQL an error in a transaction aborts it, and the abort
// releases its locks at once, long before the ROLLBACK that ends the transaction
// block.
var errAborted = lease.Gonef("an error aborted the lock transaction, and PostgreSQL released its locks with it")

type touchResult int

const (
	notTouched   touchResult = iota // the connection was busy, or not pgx
	touched                         // the lease's transaction answered
	touchAborted                    // the transaction is aborted (25P02): its locks are gone
)

// touch runs a statement in the lease's transaction, through pgx, if the connection
// is not busy with a statement or result of the caller's. It reports whether it did
// and the transaction is the lease's, or whether the transaction is aborted. It waits
// for the connection at most touchWait (a statement of the caller's that starts
// meanwhile holds it).
func (s *Lease) touch(ctx context.Context) touchResult {
	res := make(chan touchResult, 1)
	go func() {
		ok := notTouched
		s.conn.Raw(func(dc any) error {
			p, isPgx := dc.(pgxConn)
			if !isPgx || p.Conn() == nil || p.Conn().PgConn().IsBusy() {
				return nil
			}
			var now time.Time
			tctx, cancel := context.WithTimeout(context.Background(), touchWait)
			defer cancel()
			err := p.Conn().QueryRow(tctx, "SELECT now()").Scan(&now)
			switch {
			case err == nil && now.Equal(s.since):
				ok = touched
			case sqlerr.IsCode(err, "25P02"):
				ok = touchAborted
			}
			return nil
		})
		res <- ok
	}()
	t := time.NewTimer(touchWait)
	defer t.Stop()
	select {
	case ok := <-res:
		return ok
	case <-t.C:
		return notTouched // the goroutine finishes when the caller's statement does
	case <-ctx.Done():
		return notTouched
	}
}

// touchWait bounds a touch.
const touchWait = time.Second

// pgxConn is a driver connection that exposes its *pgx.Conn (pgx's stdlib).
type pgxConn interface{ Conn() *pgx.Conn }

func (s *Lease) myKeepAlive(ctx context.Context) (time.Duration, error) {
	var (
		command sql.NullString
		secs    sql.NullInt64
		state   sql.NullString
		uptime  sql.NullInt64
		token   sql.NullInt64
	)
	q := fmt.Sprintf(s.l.myStmts(ctx).activity, namekey.MySQLHex(s.key), s.session)
	err := s.l.db.QueryRowContext(ctx, q).Scan(&command, &secs, &state, &uptime, &token)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, lease.Gonef("session %d ended", s.session)
	}
	if err != nil {
		return 0, err
	}
	if uptime.Valid && time.Duration(uptime.Int64)*time.Second < time.Since(s.since)-time.Second {
		return 0, lease.Gonef("the server restarted (uptime %ds): session %d is gone", uptime.Int64, s.session)
	}
	if !s.l.cfg.noToken && token.Valid && token.Int64 >= s.token {
		return 0, lease.Gonef("the lock transaction committed early (a DDL statement or LOCK TABLES in it?): committed token %d", token.Int64)
	}
	ttl := time.Duration(pin.Seconds(s.l.cfg.Timing.TTL)) * time.Second // MySQL's wait_timeout
	if command.String == "Sleep" {
		// TIME is whole seconds, rounded down: the session may have been idle up to a
		// second longer.
		return ttl - time.Duration(secs.Int64+1)*time.Second, nil
	}
	if sending(state.String) {
		return 0, fmt.Errorf("session is sending to the client (%s)", state.String)
	}
	return ttl, nil
}

// GiveBack ends the transaction: COMMIT for Release (after checking on MySQL that the
// transaction is still the lease's, if it was handed out), ROLLBACK for Rollback and
// after a loss.
func (k keeper) GiveBack(ctx context.Context, lost bool) error {
	s := k.s
	if lost || !s.commit {
		return s.rollback(ctx, lost)
	}
	if s.l.dialect == sqllock.MySQL && s.handed.Load() {
		// Only a statement can end an InnoDB transaction early (DDL, LOCK TABLES, a
		// deadlock or lock wait rollback; an idle transaction is never a deadlock
		// victim), and only the caller's run on it: a transaction never handed out
		// needs no check (a Galera abort of it fails the COMMIT itself).
		if err := s.myStillOpen(ctx); err != nil {
			s.rollback(ctx, true)
			return err
		}
	}
	err := s.bounded(ctx, s.tx.Commit)
	switch {
	case err == nil:
		s.l.pins.Put(s.conn)
		return nil
	case errors.Is(err, pgx.ErrTxCommitRollback):
		// COMMIT of an aborted transaction rolls back; the locks went at the error.
		s.l.pins.Put(s.conn)
		return fmt.Errorf("%w: nothing was committed", errAborted)
	case errors.Is(err, errCommitTimeout):
		// bounded discards the connection once COMMIT returns.
		return s.core.Label().Err("release", ErrCommitUnknown, err)
	case sqlerr.Is(err, sqlerr.SessionLost):
		s.l.pins.Discard(s.conn)
		return s.core.Label().Err("release", ErrCommitUnknown, err)
	case sqlerr.Is(err, sqlerr.Deadlock):
		// A deadlock or certification failure at COMMIT (Galera: 1213; Group
		// Replication: 3101, or 1180 carrying a lock deadlock): rolled back, the lock
		// was not held as a lock should be.
		s.l.pins.Discard(s.conn)
		return lease.Gone(fmt.Errorf("COMMIT failed, nothing was committed: %w", err))
	}
	s.l.pins.Discard(s.conn)
	return s.core.Label().Err("release", nil, fmt.Errorf("COMMIT failed, nothing was committed: %w", err))
}

// rollback rolls back, bounded by ctx, and returns the connection (discarding the
// session if anything is in doubt).
func (s *Lease) rollback(ctx context.Context, doubtful bool) error {
	err := s.bounded(ctx, s.tx.Rollback)
	if err != nil && errors.Is(err, sql.ErrTxDone) {
		err = nil
	}
	switch {
	case errors.Is(err, errCommitTimeout):
		// bounded discards the connection once ROLLBACK returns.
	case err != nil || doubtful:
		s.l.pins.Discard(s.conn)
	default:
		s.l.pins.Put(s.conn)
	}
	if err != nil && sqlerr.Is(err, sqlerr.SessionLost) {
		return lease.Gone(fmt.Errorf("session lost: %w", err))
	}
	return nil // the lock is free with the transaction, or with the discarded session
}

var errCommitTimeout = errors.New("no reply before the context ended")

// bounded runs end (the transaction's Commit or Rollback, which take no context) and
// returns when it returns or when ctx ends. In the latter case the session is broken
// from outside so that the server ends the transaction, and errCommitTimeout is
// returned. With pgx the socket is closed too, so end returns at once, and it runs on
// the caller's goroutine. On MySQL, whose socket cannot be closed from here, end runs
// on a goroutine of its own, stuck until the server's kill reaches the client or TCP
// gives up (hours, if the replies are lost in the network); the connection is
// discarded when it returns.
func (s *Lease) bounded(ctx context.Context, end func() error) error {
	if s.target.pgc != nil {
		// pgx: the socket can be closed from outside, so end runs here and a
		// callback breaks the session if ctx ends first (no goroutine, no hand-off,
		// unless it does).
		broke := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			s.breakSession()
			close(broke)
		})
		err := end()
		if stop() {
			return err
		}
		<-broke
		s.l.pins.Discard(s.conn)
		if err == nil {
			return nil // it ended in time after all: the session was broken after it
		}
		return fmt.Errorf("%w: %w", errCommitTimeout, ctx.Err())
	}
	res := make(chan error, 1)
	go func() { res <- end() }()
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
	}
	s.breakSession()
	go func() {
		<-res
		s.l.pins.Discard(s.conn)
	}()
	return fmt.Errorf("%w: %w", errCommitTimeout, ctx.Err())
}

// breakSession ends the lease's session on the server and, where the driver lets us,
// closes its socket, so that a statement stuck on it returns. The kill runs in the
// background (for up to 1 s): the caller, whose context has ended, returns at once
// (a Release returns within its context, even when the server cannot be reached).
func (s *Lease) breakSession() {
	if s.target.pgc != nil {
		s.target.pgc.Conn().Close() // the socket: the stuck read returns at once
	}
	q := "SELECT pg_terminate_backend(" + fmt.Sprint(s.session) + ")"
	if s.l.dialect == sqllock.MySQL {
		q = "KILL " + fmt.Sprint(s.session)
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := s.l.db.ExecContext(ctx, q); err != nil {
			s.l.cfg.Logger.Debug("sqllock/forupdate: could not end the session of a stuck COMMIT", "session", s.session, "err", err)
		}
	}()
}

// myStillOpen checks, on the lease's own session, that its transaction was not ended
// early by the server (DDL, LOCK TABLES, a deadlock or lock wait timeout rollback),
// which would have freed the lock. MariaDB tells it (@@in_transaction). On MySQL a
// locking read of the lock row that does not wait shows it: another holder makes it
// fail, and without the lease's uncommitted token (WithoutToken aside) the
// transaction is not the lease's.
func (s *Lease) myStillOpen(ctx context.Context) error {
	var open sql.NullInt64
	var tok sql.NullInt64
	err := s.tx.QueryRowContext(ctx, s.l.myStmts(ctx).stillOpen(s.key)).Scan(&tok, &open)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return lease.Gonef("the lock row is gone")
	case sqlerr.Is(err, sqlerr.LockTimeout):
		return lease.Gonef("the lock transaction ended early and another client holds the lock now")
	case err != nil && ctx.Err() != nil:
		// No reply before ctx ended: COMMIT is not sent, but whether the transaction
		// had already ended, and committed, early is what the check would have told.
		return s.core.Label().Err("release", ErrCommitUnknown,
			fmt.Errorf("the check before COMMIT got no reply (COMMIT not sent): %w", err))
	case err != nil:
		if sqlerr.Is(err, sqlerr.SessionLost) {
			return lease.Gone(fmt.Errorf("session lost: %w", err))
		}
		return s.core.Label().Err("release", nil, err)
	case open.Valid && open.Int64 == 0:
		return lease.Gonef("the lock transaction ended early (a DDL statement, LOCK TABLES, a deadlock or lock wait timeout rollback)")
	case !s.l.cfg.noToken && tok.Int64 != s.token:
		return lease.Gonef("the lock transaction ended early (the row shows token %d, not the lease's %d)", tok.Int64, s.token)
	}
	return nil
}

// run runs fn in the lease's transaction and ends the lease: commit if fn returned
// nil, rollback otherwise or if fn panicked.
func (s *Lease) run(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) (err error) {
	fctx, stop := sqllock.LeaseContext(ctx, s)
	// Ending the lease must not depend on ctx, which may have ended.
	ectx := context.WithoutCancel(ctx)
	defer func() {
		stop()
		if p := recover(); p != nil {
			s.Rollback(ectx)
			panic(p)
		}
	}()
	ferr := fn(fctx, s.Tx())
	stop()
	if ferr != nil {
		rerr := s.Rollback(ectx)
		if errors.Is(rerr, sqllock.ErrLost) {
			return errors.Join(ferr, rerr)
		}
		return ferr
	}
	return s.Release(ectx)
}

// observed returns the lease's core and token, for the lease core's telemetry.
func (s *Lease) observed() (*lease.Lease, int64) { return s.core, s.token }
