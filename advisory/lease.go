package advisory

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Lease is a held advisory lock: the sqllock.Lease that Acquire and TryAcquire
// return. It is safe for concurrent use.
type Lease struct {
	s        *session
	done     chan struct{}
	mu       sync.Mutex
	released bool
	err      error // set when the hold ended on its own (released, or its session ended)
}

var _ sqllock.Lease = (*Lease)(nil)

// Name returns the lock name (for AcquireKey, "pg_advisory_lock(<key>)").
func (le *Lease) Name() string { return le.s.id.name }

// Token returns the fencing token of this acquisition, strictly greater than the
// token of every earlier acquisition of the name, across crashes and restarts of the
// server. It is drawn with no commit of its own: the epoch of the server's run times
// 2^44 plus a counter shared by every name (so tokens are large and not consecutive).
// Each run of the server records its epoch once, durably, before its first token,
// one above the largest recorded (sqllock_epoch, whose rows must never be deleted).
// On PostgreSQL the counter is a sequence read by the locking statement itself, and
// the epoch is committed synchronously. On MySQL the counter is the server's
// UUID_SHORT(), which starts afresh at every start of the server, counted from the
// value it had when the run's epoch was recorded (a row of the MEMORY table
// sqllock_runs, which the server empties when it starts, so the first token of
// every run takes a new epoch): the draw is a SELECT that writes nothing (no InnoDB
// write, no redo log flush, nothing in the binary log), and is the same statement as
// GET_LOCK(name, 0) when the lock is free. The run's row names its server
// (@@server_id): a replica, to which replication carries the row, records a run of
// its own once it is promoted, above every epoch it has (with lossless
// semi-synchronous replication, every epoch of its former source). With
// WithGaleraSingleWriter, whose nodes do not replicate sqllock_runs, every draw also
// checks that the run is of the newest epoch recorded (a node that clients fail back
// to may keep an older one) and takes a new one if not. The epoch is durable as
// commits on the server are (innodb_flush_log_at_trx_commit=1, the default).
// Reentrant holds of one owner share the token of the first. It is 0 with
// WithoutToken.
//
// Upgrading from a version that drew tokens from sqllock_fence (per-name counters):
// the new tokens are larger than any of those (they would have to have counted 2^44
// acquisitions of a name), but replicas still running the old version keep drawing
// small ones; upgrade every replica before relying on the order.
func (le *Lease) Token() int64 { return le.s.token }

// SessionID returns the server session that holds the lock: the backend PID on
// PostgreSQL, the CONNECTION_ID() on MySQL. Useful to find it in pg_stat_activity or
// the processlist.
func (le *Lease) SessionID() int64 { return le.s.sid }

// Done is closed when the lease is released, or lost: its session died, or no
// keep-alive succeeded before the local deadline (see the package documentation).
func (le *Lease) Done() <-chan struct{} {
	le.s.core.Done() // looks at the deadline
	return le.done
}

// Err returns nil while the lease is held, an error matching sqllock.ErrLost after a
// loss and one matching sqllock.ErrNotHeld after Release.
func (le *Lease) Err() error {
	le.mu.Lock()
	err := le.err
	le.mu.Unlock()
	if err != nil {
		return err
	}
	if err := le.s.core.Err(); errors.Is(err, sqllock.ErrLost) {
		return err
	}
	return nil
}

// end ends this hold with err, once.
func (le *Lease) end(err error) {
	le.mu.Lock()
	defer le.mu.Unlock()
	if le.err == nil {
		le.err = err
		close(le.done)
	}
}

// Release gives the lease up. The server lock is released (pg_advisory_unlock,
// RELEASE_LOCK) when the last hold of its session goes, and the session's bound is
// put back before the connection returns to the pool. If the unlock statement cannot
// run (the connection breaks) the session is closed instead, which frees the lock on
// the server (at the latest when its bound runs out, if the server cannot be
// reached; behind a transaction-pooling proxy the Locker has not noticed yet, only
// when the pooled backend is idle for the bound: see the README's known
// limitations). It gives the lock back even if ctx has already ended. Release returns an
// error matching sqllock.ErrLost if the lease had been lost; later calls return nil.
func (le *Lease) Release(ctx context.Context) error {
	le.mu.Lock()
	if le.released {
		le.mu.Unlock()
		return nil
	}
	le.released = true
	le.mu.Unlock()
	return le.s.release(ctx, le)
}

// session is one held server lock on one pinned connection, shared by the reentrant
// holds of one owner.
type session struct {
	l     *Locker
	conn  *sql.Conn
	id    lockID
	sid   int64
	token int64
	core  *lease.Lease

	mu     sync.Mutex
	holds  int
	leases map[*Lease]struct{}
	ended  bool

	owner      holdKey     // set under lockerState.mu
	ownerEntry *ownerEntry // set under lockerState.mu
}

// startSession wraps a lock granted at granted, makes its first lease and starts its
// keep-alive.
func (l *Locker) startSession(conn *sql.Conn, id lockID, sid, token int64, granted time.Time) *Lease {
	s := &session{l: l, conn: conn, id: id, sid: sid, token: token, leases: make(map[*Lease]struct{}, 1)}
	le := &Lease{s: s, done: make(chan struct{})}
	s.holds = 1
	s.leases[le] = struct{}{}
	s.core = lease.Prepare(s, lease.Params{
		Timing:  l.cfg.Timing,
		Granted: granted,
		Label:   l.cfg.Label("advisory", l.dialect, id.name),
		Log:     l.cfg.Logger,
		OnEnd:   s.onEnd,
	})
	s.core.Run()
	return le
}

// onEnd runs once the session's lease ended: every hold ends with it.
func (s *session) onEnd() {
	s.mu.Lock()
	s.ended = true
	leases := s.leases
	s.leases = nil
	s.mu.Unlock()
	err := s.core.Err()
	for le := range leases {
		le.end(err)
	}
	s.removeOwner()
}

// addHold adds a reentrant hold, or returns nil if the session ended.
func (s *session) addHold() *Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended || s.core.Err() != nil {
		return nil
	}
	le := &Lease{s: s, done: make(chan struct{})}
	s.holds++
	s.leases[le] = struct{}{}
	return le
}

func (s *session) isEnded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ended
}

func (s *session) errorf(op string, kind, err error) error {
	return lease.NewError(op, s.l.dialect, s.id.name, kind, err)
}

func (s *session) removeOwner() {
	st := s.l.st
	st.mu.Lock()
	if s.ownerEntry != nil && st.owners[s.owner] == s.ownerEntry {
		delete(st.owners, s.owner)
	}
	st.mu.Unlock()
}

func (s *session) release(ctx context.Context, le *Lease) error {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		// Waits for the clean-up after a loss (the session discarded) to finish, so
		// that nothing of the lease is left when Release returns.
		s.core.Release(ctx)
		if err := s.core.Err(); errors.Is(err, sqllock.ErrLost) {
			return err
		}
		return nil
	}
	delete(s.leases, le)
	s.holds--
	if s.holds > 0 {
		s.mu.Unlock()
		if err := s.core.Err(); errors.Is(err, sqllock.ErrLost) {
			le.end(err)
			return err
		}
		le.end(s.errorf("release", sqllock.ErrNotHeld, nil))
		return nil
	}
	s.mu.Unlock()
	s.removeOwner()
	err := s.core.Release(ctx)
	le.end(s.core.Err())
	return err
}

// KeepAlive checks that the pinned session is the one that took the lock (and, on
// MySQL, that it still holds it). The statement also restarts the session's idle
// timer on the server: the bound.
func (s *session) KeepAlive(ctx context.Context) (time.Duration, error) {
	ctx = lease.OwnConn(ctx) // Release lets it finish: cancelling it would break the session
	var sid int64
	if s.l.dialect == sqllock.Postgres {
		if err := pgRow(ctx, s.conn, "SELECT pg_backend_pid()", nil, &sid); err != nil {
			return 0, keepAliveErr(err)
		}
		// A *sql.Conn keeps its driver connection: only a proxy moves it.
		if refusal := s.l.leftBehind(ctx, s.sid, sid, "the keep-alive of the session that took the lock"); refusal != nil {
			return 0, lease.Gone(refusal)
		}
	} else {
		var holder sql.NullInt64
		err := s.conn.QueryRowContext(ctx, "SELECT CONNECTION_ID(), IS_USED_LOCK('"+s.id.myName+"')").Scan(&sid, &holder)
		if err != nil {
			return 0, keepAliveErr(err)
		}
		if sid == s.sid && (!holder.Valid || holder.Int64 != sid) {
			return 0, lease.Gonef("GET_LOCK name held by session %v, not by this session %d", holder, sid)
		}
	}
	if sid != s.sid {
		return 0, lease.Gonef("session changed from %d to %d (a reconnect?)", s.sid, sid)
	}
	return 0, nil
}

// keepAliveErr: a session that is gone took its lock with it.
func keepAliveErr(err error) error {
	if sqlerr.Is(err, sqlerr.SessionLost) {
		return lease.Gone(fmt.Errorf("session lost: %w", err))
	}
	return err
}

// GiveBack releases the server lock and returns the connection. After a loss it
// closes the session, which frees whatever it still held.
func (s *session) GiveBack(ctx context.Context, lost bool) error {
	if lost {
		s.l.pins.Discard(s.conn)
		return nil
	}
	keep := s.l.pins.Reserve() // PostgreSQL: the unlock leaves the bound on a kept session
	held, ranOn, err := s.unlock(ctx, keep)
	var moved error // PostgreSQL: the unlock ran on another backend than the lock
	if s.l.dialect == sqllock.Postgres && err == nil {
		moved = s.l.leftBehind(ctx, s.sid, ranOn, "the unlock of the lock taken")
	}
	if keep && (err != nil || !held || moved != nil) {
		s.l.pins.Unreserve()
	}
	switch {
	case moved != nil:
		s.l.pins.Discard(s.conn)
		return lease.Gone(moved)
	case err != nil:
		s.l.pins.Discard(s.conn)
		if sqlerr.Is(err, sqlerr.SessionLost) {
			return lease.Gone(fmt.Errorf("session lost: %w", err))
		}
		// Closing the session frees the lock on the server's side: at once if the
		// server sees the close, else (a partition, a server that does not answer)
		// when its bound runs out. Not given back: Release says so (an error, not nil).
		s.l.cfg.Logger.Warn("sqllock/advisory: unlock failed, session closed instead",
			"name", s.id.name, "dialect", s.l.dialect.String(), "err", err)
		return fmt.Errorf("unlock failed, session closed instead: %w", err)
	case !held:
		// On PostgreSQL the unlock ran on the backend that took the lock (else moved).
		s.l.pins.Discard(s.conn)
		return lease.Gonef("the session no longer held the lock")
	case keep:
		s.l.pins.PutKept(s.conn, s.sid)
	default:
		s.l.pins.PutSession(s.conn, s.sid)
	}
	return nil
}

// unlock releases the server lock, and on PostgreSQL puts the session's bound back
// in the same statement unless keep (the Locker keeps the session with its bound). It
// returns whether the lock was held, and the backend the unlock ran on (PostgreSQL;
// the lease's own on MySQL).
func (s *session) unlock(ctx context.Context, keep bool) (held bool, ranOn int64, err error) {
	if s.l.dialect == sqllock.Postgres {
		k := fresh
		if keep {
			k = kept
		}
		return s.l.pgUnlock(ctx, s.conn, s.id, s.sid, k)
	}
	var got sql.NullInt64
	err = s.l.myRow(ctx, s.conn, "SELECT RELEASE_LOCK(?)", s.id.myName, &got)
	return got.Valid && got.Int64 == 1, s.sid, err
}

// observed returns the lease's core and token, for the lease core's telemetry.
func (le *Lease) observed() (*lease.Lease, int64) { return le.s.core, le.s.token }
