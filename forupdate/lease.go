package forupdate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/leasestate"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Lease is a held forupdate lock: an open transaction on one pooled connection that
// holds the row lock of its name. Release commits the transaction, and with it every
// write made through Tx; Rollback discards them. Either frees the lock and returns the
// connection to the pool. Its methods are safe for concurrent use, but Tx, like any
// *sql.Tx, runs one statement at a time.
type Lease struct {
	l       *Locker
	name    string
	token   int64
	session int64
	since   time.Time // PostgreSQL: a time the session was alive (see pgAlive)
	conn    *sql.Conn
	tx      *sql.Tx
	st      *leasestate.State

	mu    sync.Mutex // serialises the end of the transaction
	ended bool

	stop   context.CancelFunc // stops the keepalive, and cancels a check under way
	exited chan struct{}      // closed when the keepalive returned
}

var _ sqllock.Lease = (*Lease)(nil)

func (l *Locker) newLease(name string, g grant, conn *sql.Conn, tx *sql.Tx) *Lease {
	kctx, stop := context.WithCancel(context.Background())
	lease := &Lease{
		l: l, name: name, token: g.token, session: g.sid, since: g.since, conn: conn, tx: tx,
		st: leasestate.New(), stop: stop, exited: make(chan struct{}),
	}
	go lease.keepalive(kctx)
	return lease
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
// it commits with Release. Do not call its Commit or Rollback; use the lease's.
func (s *Lease) Tx() *sql.Tx { return s.tx }

// SessionID returns the id of the database session holding the lock: the backend
// pid on PostgreSQL (pg_backend_pid()), the connection id on MySQL
// (CONNECTION_ID()). For diagnostics and fault tests.
func (s *Lease) SessionID() int64 { return s.session }

// Done is closed when the lease was released, rolled back or lost.
func (s *Lease) Done() <-chan struct{} { return s.st.Done() }

// Err returns nil while the lease is held, an error matching sqllock.ErrLost once its
// session is known to be gone, and one matching sqllock.ErrNotHeld after Release or
// Rollback.
func (s *Lease) Err() error { return s.st.Err() }

// Release commits the transaction, and so the work done in Tx together with the new
// token, which frees the lock. It returns an error matching sqllock.ErrLost if the
// session was lost (nothing was committed), or an *sqllock.Error carrying the COMMIT's
// error if the commit failed otherwise (a deferred constraint, a serialization
// failure: nothing was committed, the lock is free). Later calls return nil, or
// ErrLost again.
//
// ctx is not used: database/sql gives COMMIT no context, and Release commits even if
// ctx has ended, because a caller whose context ended after its work was done must
// not lose that work silently. To discard the work, call Rollback.
func (s *Lease) Release(ctx context.Context) error { return s.end("release", true) }

// Rollback rolls the transaction back, discarding the work done in Tx, and frees the
// lock. Like Release it is safe to call more than once, and after Release; ctx is not
// used.
func (s *Lease) Rollback(ctx context.Context) error { return s.end("rollback", false) }

func (s *Lease) lostErr(op string, cause error) error {
	return &sqllock.Error{Op: op, Dialect: s.l.dialect, Name: s.name, Kind: sqllock.ErrLost, Err: cause}
}

func (s *Lease) end(op string, commit bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		if err := s.st.Err(); errors.Is(err, sqllock.ErrLost) {
			return err
		}
		return nil
	}
	s.ended = true
	// A keepalive check under way may wait for a pooled connection: cancel it rather
	// than hold the lock until it gives up.
	s.stop()
	<-s.exited
	defer s.conn.Close()

	if err := s.st.Err(); errors.Is(err, sqllock.ErrLost) {
		s.tx.Rollback()
		return err
	}
	var err error
	if commit {
		err = s.tx.Commit()
	} else {
		err = s.tx.Rollback()
	}
	if err != nil && sqlerr.Is(err, sqlerr.SessionLost) {
		lost := s.lostErr(op, err)
		s.st.End(lost)
		return lost
	}
	s.st.End(&sqllock.Error{Op: op, Dialect: s.l.dialect, Name: s.name, Kind: sqllock.ErrNotHeld})
	if err != nil && !(commit == false && errors.Is(err, sql.ErrTxDone)) {
		return &sqllock.Error{Op: op, Dialect: s.l.dialect, Name: s.name, Err: err}
	}
	return nil
}

// keepalive checks every interval, from another pooled connection, that the
// lease's session still exists, and ends the lease with ErrLost when it does not. A
// check that fails (for example because the pool is exhausted) proves nothing and is
// only logged.
func (s *Lease) keepalive(kctx context.Context) {
	defer close(s.exited)
	t := time.NewTicker(s.l.cfg.keepalive)
	defer t.Stop()
	for {
		select {
		case <-kctx.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(kctx, s.l.cfg.keepalive)
		alive, err := sessionAlive(ctx, s.l.db, s.l.dialect, s.session, s.since)
		cancel()
		switch {
		case kctx.Err() != nil:
			return
		case err != nil:
			s.l.cfg.logger.Warn("sqllock/forupdate: keepalive check failed", "name", s.name, "session", s.session, "err", err)
		case !alive:
			s.l.cfg.logger.Warn("sqllock/forupdate: lock lost: session is gone", "name", s.name, "session", s.session)
			s.st.End(s.lostErr("keepalive", fmt.Errorf("session %d is gone", s.session)))
			return
		}
	}
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
	ferr := fn(fctx, s.tx)
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
