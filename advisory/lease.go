package advisory

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/leasestate"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Lease is a held advisory lock: the sqllock.Lease that Acquire and TryAcquire
// return. It is safe for concurrent use.
type Lease struct {
	s        *session
	st       *leasestate.State
	mu       sync.Mutex
	released bool
}

var _ sqllock.Lease = (*Lease)(nil)

// Name returns the lock name (for AcquireKey, "pg_advisory_lock(<key>)").
func (le *Lease) Name() string { return le.s.id.name }

// Token returns the fencing token of this acquisition: the per-name counter of
// sqllock_fence, bumped on the lock's session right after the grant. Reentrant holds
// of one owner share the token of the first. It is 0 with WithoutToken.
func (le *Lease) Token() int64 { return le.s.token }

// SessionID returns the server session that holds the lock: the backend PID on
// PostgreSQL, the CONNECTION_ID() on MySQL. Useful to find it in pg_stat_activity or
// the processlist.
func (le *Lease) SessionID() int64 { return le.s.sid }

// Done is closed when the lease is released, or lost because its session died (within
// about one keepalive interval of the death).
func (le *Lease) Done() <-chan struct{} { return le.st.Done() }

// Err returns nil while the lease is held, an error matching sqllock.ErrLost after a
// loss and one matching sqllock.ErrNotHeld after Release.
func (le *Lease) Err() error { return le.st.Err() }

// Release gives the lease up. The server lock is released (pg_advisory_unlock,
// RELEASE_LOCK) when the last hold of its session goes, and the connection returns to
// the pool. If the unlock statement cannot run (ctx ends, the connection breaks) the
// session is closed instead, which frees the lock on the server. Release returns an
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

type session struct {
	l     *Locker
	conn  *sql.Conn
	id    lockID
	sid   int64
	token int64

	mu      sync.Mutex
	holds   int
	leases  map[*Lease]struct{}
	ended   bool  // released or lost
	lostErr error // set when lost
	cause   error // why it was lost

	kaMu      sync.Mutex  // held by a running check; serialises it with Release
	kaTimer   *time.Timer // runs the next check
	kaStopped bool

	owner      holdKey     // set under lockerState.mu
	ownerEntry *ownerEntry // set under lockerState.mu
}

// startSession wraps a granted lock, makes its first lease and starts the keepalive.
func (l *Locker) startSession(conn *sql.Conn, id lockID, sid, token int64) *Lease {
	s := &session{
		l: l, conn: conn, id: id, sid: sid, token: token,
		leases: make(map[*Lease]struct{}, 1),
	}
	le := &Lease{s: s, st: leasestate.New()}
	s.holds = 1
	s.leases[le] = struct{}{}
	// A timer rather than a goroutine per lease: nothing runs between checks, and
	// Release needs no handshake with an idle keepalive.
	s.kaMu.Lock()
	s.kaTimer = time.AfterFunc(l.cfg.keepalive, s.keepalive)
	s.kaMu.Unlock()
	return le
}

// addHold adds a reentrant hold, or returns nil if the session ended.
func (s *session) addHold() *Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return nil
	}
	le := &Lease{s: s, st: leasestate.New()}
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
	return &sqllock.Error{Op: op, Dialect: s.l.dialect, Name: s.id.name, Kind: kind, Err: err}
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
		lost := s.lostErr
		s.mu.Unlock()
		if lost != nil {
			return s.errorf("release", sqllock.ErrLost, s.cause)
		}
		return nil
	}
	delete(s.leases, le)
	s.holds--
	le.st.End(s.errorf("release", sqllock.ErrNotHeld, nil))
	if s.holds > 0 {
		s.mu.Unlock()
		return nil
	}
	s.ended = true
	s.mu.Unlock()
	s.removeOwner()
	s.kaMu.Lock() // waits for a running check
	s.kaStopped = true
	s.kaTimer.Stop()
	s.kaMu.Unlock()

	held, err := s.unlock(ctx)
	switch {
	case err != nil:
		interrupt.Release(s.conn, true)
		if sqlerr.Is(err, sqlerr.SessionLost) {
			return s.errorf("release", sqllock.ErrLost, err)
		}
		// Closing the session freed the lock.
		s.l.cfg.logger.Warn("sqllock/advisory: unlock failed, session closed instead",
			"name", s.id.name, "dialect", s.l.dialect.String(), "err", err)
		return nil
	case !held:
		interrupt.Release(s.conn, true)
		return s.errorf("release", sqllock.ErrLost, errors.New("the session no longer held the lock"))
	}
	return s.conn.Close()
}

func (s *session) unlock(ctx context.Context) (bool, error) {
	if s.l.dialect == sqllock.Postgres {
		var ok bool
		err := s.conn.QueryRowContext(ctx, s.l.pgStmts(s.id).unlock, s.id.pgArgs()...).Scan(&ok)
		return ok, err
	}
	var got sql.NullInt64
	err := s.conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK('"+s.id.myName+"')").Scan(&got)
	return got.Valid && got.Int64 == 1, err
}

// keepalive runs one check and schedules the next.
func (s *session) keepalive() {
	s.kaMu.Lock()
	defer s.kaMu.Unlock()
	if s.kaStopped {
		return
	}
	if err := s.check(); err != nil {
		s.kaStopped = true
		s.lose(err)
		return
	}
	s.kaTimer.Reset(s.l.cfg.keepalive)
}

// check verifies that the pinned session is the one that took the lock (and, on
// MySQL, that it still holds it). It is not cancelled by Release, which waits for it:
// cancelling a statement can break the connection and lose the lock.
func (s *session) check() error {
	ctx, cancel := context.WithTimeout(context.Background(), max(s.l.cfg.keepalive, time.Second))
	defer cancel()
	var sid int64
	if s.l.dialect == sqllock.Postgres {
		if err := s.conn.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&sid); err != nil {
			return err
		}
	} else {
		var holder sql.NullInt64
		err := s.conn.QueryRowContext(ctx, "SELECT CONNECTION_ID(), IS_USED_LOCK('"+s.id.myName+"')").Scan(&sid, &holder)
		if err != nil {
			return err
		}
		if sid == s.sid && (!holder.Valid || holder.Int64 != sid) {
			return fmt.Errorf("GET_LOCK name held by session %v, not by this session %d", holder, sid)
		}
	}
	if sid != s.sid {
		return fmt.Errorf("session changed from %d to %d (a pooler or reconnect?)", s.sid, sid)
	}
	return nil
}

func (s *session) lose(cause error) {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	s.lostErr, s.cause = s.errorf("keepalive", sqllock.ErrLost, cause), cause
	leases := s.leases
	s.leases = nil
	s.mu.Unlock()
	for le := range leases {
		le.st.End(s.lostErr)
	}
	s.removeOwner()
	interrupt.Release(s.conn, true)
	s.l.cfg.logger.Warn("sqllock/advisory: lock lost", "name", s.id.name,
		"dialect", s.l.dialect.String(), "session", s.sid, "err", cause)
}
