package uniqueindex

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/leasestate"
)

// Lease is a held uniqueindex lock. Its methods are safe for concurrent use.
type Lease struct {
	l                *Locker
	name             string
	key, owner       []byte
	token            int64
	ttl, renew       time.Duration
	margin           time.Duration
	reentrant        bool
	state            *leasestate.State
	slot             *queue
	stop, refreshed  chan struct{}
	watchDone        chan struct{}
	stopOnce, rlOnce sync.Once

	mu       sync.Mutex
	lastOK   time.Time // start of the last successful renewal (l.now, monotonic)
	released bool
}

func (l *Locker) newLease(name string, key, owner []byte, token int64, ttl, renew time.Duration, reentrant bool, start time.Time, slot *queue) *Lease {
	le := &Lease{
		l: l, name: name, key: key, owner: owner, token: token, ttl: ttl, renew: renew,
		margin: ttl / 5, reentrant: reentrant, state: leasestate.New(), slot: slot,
		stop: make(chan struct{}), refreshed: make(chan struct{}, 1), watchDone: make(chan struct{}),
		lastOK: start,
	}
	go le.watch()
	return le
}

// Name returns the lock name.
func (le *Lease) Name() string { return le.name }

// Token returns the fencing token: strictly greater than the token of every earlier
// acquisition of the name (a reentrant acquisition shares the token of the hold it
// joins).
func (le *Lease) Token() int64 { return le.token }

// Done is closed when the lease is released or lost.
func (le *Lease) Done() <-chan struct{} { return le.state.Done() }

// Err is nil while held, then matches sqllock.ErrLost or sqllock.ErrNotHeld.
func (le *Lease) Err() error { return le.state.Err() }

// deadline is when the lease is given up locally without a successful renewal.
func (le *Lease) deadline() time.Time {
	le.mu.Lock()
	defer le.mu.Unlock()
	return le.lastOK.Add(le.ttl - le.margin)
}

func (le *Lease) renewed(start time.Time) {
	le.mu.Lock()
	if start.After(le.lastOK) {
		le.lastOK = start
	}
	le.mu.Unlock()
}

// end ends the lease once and hands the in-process queue slot on.
func (le *Lease) end(err error) bool {
	if !le.state.End(err) {
		return false
	}
	if le.slot != nil {
		le.l.dequeue(string(le.key), le.slot)
	}
	le.l.wake(string(le.key), false)
	return true
}

func (le *Lease) lose(cause error) {
	if le.end(&sqllock.Error{Op: "keepalive", Dialect: le.l.dialect, Name: le.name, Kind: sqllock.ErrLost, Err: cause}) {
		le.l.cfg.logger.Warn("sqllock/uniqueindex: lease lost", "name", le.name, "token", le.token, "err", cause)
	}
}

// watch renews the lease every renew interval until it is released or lost.
func (le *Lease) watch() {
	defer close(le.watchDone)
	next := le.deadline().Add(-le.ttl + le.margin + le.renew)
	retry := le.renew / 8
	for {
		now := le.l.now()
		dl := le.deadline()
		wake := next
		if dl.Before(wake) {
			wake = dl
		}
		t := time.NewTimer(wake.Sub(now))
		select {
		case <-le.stop:
			t.Stop()
			return
		case <-le.refreshed:
			t.Stop()
			next = le.deadline().Add(-le.ttl + le.margin + le.renew)
			continue
		case <-t.C:
		}
		start := le.l.now()
		dl = le.deadline()
		if !start.Before(dl) {
			le.lose(errors.New("no renewal succeeded within the lease time less the safety margin"))
			return
		}
		// The renewal runs in its own goroutine so that the local deadline is enforced
		// whatever the statement does: its ctx is bounded by the deadline, but a
		// statement can also be stuck where ctx is not looked at (a Go mutex, a driver
		// busy elsewhere). At the deadline the lease is lost, then the renewal is
		// cancelled and waited for.
		ctx, cancel := context.WithTimeout(context.Background(), min(dl.Sub(start), le.l.cfg.attempt))
		type result struct {
			ok  bool
			err error
		}
		ch := make(chan result, 1)
		go func() {
			ok, err := le.refresh(ctx)
			ch <- result{ok, err}
		}()
		dt := time.NewTimer(dl.Sub(start))
		var r result
		select {
		case r = <-ch:
			dt.Stop()
		case <-dt.C:
			le.lose(errors.New("no renewal succeeded within the lease time less the safety margin (renewal still in flight)"))
			cancel()
			<-ch
			return
		case <-le.stop:
			dt.Stop()
			cancel()
			<-ch
			return
		}
		cancel()
		switch {
		case r.err == nil && r.ok:
			le.renewed(start)
			next = start.Add(le.renew)
		case r.err == nil:
			le.lose(errors.New("lease row deleted or taken over"))
			return
		default:
			le.l.cfg.logger.Debug("sqllock/uniqueindex: renewal failed, retrying", "name", le.name, "err", r.err)
			next = le.l.now().Add(retry)
		}
	}
}

func (le *Lease) refresh(ctx context.Context) (bool, error) {
	var res sql.Result
	var err error
	if le.l.dialect == sqllock.Postgres {
		res, err = le.l.db.ExecContext(ctx, renewPostgres, le.key, le.owner, le.token, le.ttl.Microseconds())
	} else {
		res, err = le.l.exec(ctx, renewMySQL, le.ttl.Microseconds(), le.key, le.owner, le.token)
	}
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// Refresh renews the lease now, as the watchdog does. It returns an error matching
// sqllock.ErrLost if the row was deleted or taken over (the lease then ends), or
// sqllock.ErrNotHeld after Release. A transient error (deadlock, serialization
// failure, lock wait timeout) is retried up to 5 times with a short jittered backoff;
// if it persists, or for any other database error, Refresh returns a *sqllock.Error
// wrapping it, and the lease is still held: the watchdog goes on renewing it.
// Refresh waits at most until the lease's local deadline (TTL less the safety margin
// after the last successful renewal): if the lease was lost meanwhile, or the
// renewal could not complete before it, Refresh returns an error matching
// sqllock.ErrLost.
func (le *Lease) Refresh(ctx context.Context) error {
	if err := le.state.Err(); err != nil {
		return err
	}
	start := le.l.now()
	dl := le.deadline()
	if !start.Before(dl) {
		le.lose(errors.New("no renewal succeeded within the lease time less the safety margin"))
		return le.state.Err()
	}
	// A renewal that completes after the local deadline proves nothing: the lease may
	// have expired by the database clock meanwhile (and been taken over once the
	// blocker went away).
	rctx, cancel := context.WithTimeout(ctx, dl.Sub(start))
	defer cancel()
	var ok bool
	err := le.l.retryTransient(rctx, "refresh", func() (err error) {
		ok, err = le.refresh(rctx)
		return err
	})
	if e := le.state.Err(); e != nil {
		return e // lost (or released) meanwhile
	}
	// Past the local deadline (the watchdog may have renewed meanwhile: read it
	// again), or a renewal so slow that the row may have expired during it: lost.
	if now := le.l.now(); !now.Before(le.deadline()) || now.Sub(start) >= le.ttl-le.margin {
		le.lose(errors.New("no renewal succeeded within the lease time less the safety margin"))
		return le.state.Err()
	}
	switch {
	case err != nil:
		// Not renewed now; the lease is not lost for that: the watchdog keeps renewing.
		return &sqllock.Error{Op: "refresh", Dialect: le.l.dialect, Name: le.name, Err: err}
	case !ok:
		le.lose(errors.New("lease row deleted or taken over"))
		return le.state.Err()
	}
	le.renewed(start)
	select {
	case le.refreshed <- struct{}{}:
	default:
	}
	return nil
}

// Check verifies, inside the caller's transaction tx, that the lease is still the
// current holder of its lock, unexpired by the database clock, and share-locks its row
// until tx ends, so that no renewal, release or takeover changes it meanwhile. Make
// the business writes in tx after Check: they commit only while the lock is really
// held. It returns an error matching sqllock.ErrLost if the lease is not current. On
// MySQL, tx should be READ COMMITTED or REPEATABLE READ (locking reads see the latest
// row either way).
//
// Check cannot retry a deadlock, serialization failure or lock wait timeout: it runs
// in the caller's transaction, which the database has then aborted (PostgreSQL, and
// MySQL on a deadlock) or in which only the statement failed (MySQL lock wait
// timeout). It returns such an error as a *sqllock.Error whose cause is the driver's
// error, so that errors.As finds the *pgconn.PgError or *mysql.MySQLError: roll tx
// back and retry the whole transaction, as for any other statement of it. The share
// lock waits at most for one short statement in flight on the row (a renewal, a
// Release, a takeover, a reaper batch re-checking a row taken over since it chose it).
func (le *Lease) Check(ctx context.Context, tx *sql.Tx) error {
	q := checkMySQL
	if le.l.dialect == sqllock.Postgres {
		q = checkPostgres
	}
	var one int
	err := tx.QueryRowContext(ctx, q, le.key, le.owner, le.token).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return &sqllock.Error{Op: "check", Dialect: le.l.dialect, Name: le.name, Kind: sqllock.ErrLost,
			Err: errors.New("lease is no longer the current holder")}
	}
	if err != nil {
		return &sqllock.Error{Op: "check", Dialect: le.l.dialect, Name: le.name, Err: err}
	}
	return nil
}

// Release gives the lock up: it deletes the lease row if it is still this lease's (or
// gives one hold back, for a re-entered lock). It returns an error matching
// sqllock.ErrLost if the lease had been lost, and nil when called again.
//
// A transient error (deadlock, serialization failure, lock wait timeout, for example
// against a concurrent sweep or a transaction holding Check's share lock) is retried
// up to 5 times with a short jittered backoff, within ctx. If the row still cannot be
// deleted, Release returns a *sqllock.Error wrapping the last error: the lease has
// ended on the client (Done is closed, renewals have stopped), and the row stays until
// it expires by the database clock, at most the TTL after the last renewal, when the
// next acquirer takes it over.
func (le *Lease) Release(ctx context.Context) error {
	le.mu.Lock()
	if le.released {
		le.mu.Unlock()
		return nil
	}
	le.released = true
	le.mu.Unlock()
	le.stopOnce.Do(func() { close(le.stop) })
	<-le.watchDone

	lostBefore := le.state.Err() != nil
	var n int64
	err := le.l.retryTransient(ctx, "release", func() (err error) {
		n, err = le.delete(ctx)
		return err
	})
	if err != nil && !lostBefore {
		// The row could not be deleted (or the outcome is unknown). The lease ends here
		// and the watchdog has stopped, so the row, if still there, expires by the
		// database clock at most TTL after the last renewal; the lock is free then (taken
		// over by the next acquirer, swept by the reaper later).
		err = fmt.Errorf("lease row not deleted: the lock stays taken until it expires, at most %v after the last renewal: %w", le.ttl, err)
		le.end(&sqllock.Error{Op: "release", Dialect: le.l.dialect, Name: le.name, Kind: sqllock.ErrNotHeld, Err: err})
		return &sqllock.Error{Op: "release", Dialect: le.l.dialect, Name: le.name, Err: err}
	}
	if lostBefore {
		return le.state.Err()
	}
	if n == 0 {
		le.lose(errors.New("lease row deleted or taken over before release"))
		return &sqllock.Error{Op: "release", Dialect: le.l.dialect, Name: le.name, Kind: sqllock.ErrLost,
			Err: errors.New("lease row deleted or taken over")}
	}
	le.end(&sqllock.Error{Op: "release", Dialect: le.l.dialect, Name: le.name, Kind: sqllock.ErrNotHeld})
	return nil
}

// delete removes the row, or gives back one hold of a reentrant lease (one statement,
// then a best-effort DELETE after the last hold, see unholdPostgres).
func (le *Lease) delete(ctx context.Context) (int64, error) {
	pg := le.l.dialect == sqllock.Postgres
	if le.reentrant {
		var n, freed int64
		if pg {
			var s sql.NullString
			if err := le.l.db.QueryRowContext(ctx, unholdPostgres, le.key, le.owner, le.token).Scan(&n, &freed, &s); err != nil {
				return 0, err
			}
		} else {
			res, err := le.l.exec(ctx, unholdMySQL, le.key, le.owner, le.token)
			if err != nil {
				return 0, err
			}
			if n, err = res.RowsAffected(); err != nil {
				return 0, err
			}
			if before, err := res.LastInsertId(); err == nil && n > 0 && before <= 1 {
				freed = 1
			}
		}
		if freed > 0 {
			// The last hold: the row is expired, so free already; delete it, best effort.
			q := unholdDoneMySQL
			if pg {
				q = unholdDonePostgres
			}
			le.l.exec(ctx, q, le.key, le.owner, le.token)
		}
		return n, nil
	}
	if pg {
		var n int64
		var s sql.NullString
		err := le.l.db.QueryRowContext(ctx, releasePostgres, le.key, le.owner, le.token).Scan(&n, &s)
		return n, err
	}
	res, err := le.l.exec(ctx, releaseMySQL, le.key, le.owner, le.token)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
