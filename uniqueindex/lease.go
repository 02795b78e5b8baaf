package uniqueindex

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/wait"
)

// Lease is a held uniqueindex lock. Its methods are safe for concurrent use.
type Lease struct {
	l          *Locker
	name       string
	key, owner []byte
	token      int64
	reentrant  bool
	ttl        time.Duration // the lease's TTL, for the keeper (which may run before core is set)
	core       *lease.Lease
	// turn is the server-side line's turn that got the lock, or nil: its session holds
	// the line lock until the release statement gives it back (GiveBack).
	turn *wait.Turn
}

func (l *Locker) newLease(name string, key, owner []byte, token int64, tm lease.Timing, reentrant bool, granted time.Time, slot *wait.Slot, turn *wait.Turn) *Lease {
	le := &Lease{l: l, name: name, key: key, owner: owner, token: token, reentrant: reentrant, ttl: tm.TTL, turn: turn}
	var reentrantOwner []byte
	if reentrant {
		reentrantOwner = owner
	}
	le.core = l.b.StartLease(keeper{le}, tm, name, key, reentrantOwner, granted, slot)
	le.core.Run()
	return le
}

// Name returns the lock name.
func (le *Lease) Name() string { return le.name }

// Token returns the fencing token: strictly greater than the token of every earlier
// acquisition of the name. A reentrant acquisition shares the token of the hold it
// joins.
func (le *Lease) Token() int64 { return le.token }

// Done is closed when the lease is released or lost. A passed local deadline closes
// it at once, whoever looks first.
func (le *Lease) Done() <-chan struct{} { return le.core.Done() }

// Err is nil while held, then matches sqllock.ErrLost or sqllock.ErrNotHeld.
func (le *Lease) Err() error { return le.core.Err() }

// Refresh renews the lease now, as the keep-alive does. It returns an error matching
// sqllock.ErrLost if the row was deleted, taken over or expired (the lease then ends)
// or could not be renewed before the lease's local deadline, sqllock.ErrNotHeld after
// Release, and a *sqllock.Error carrying the database error if the renewal failed for
// another reason: the lease is then still held, and the keep-alive goes on renewing
// it. It waits at most until ctx ends or the local deadline passes.
func (le *Lease) Refresh(ctx context.Context) error { return le.core.Refresh(ctx) }

// Check verifies, inside the caller's transaction tx, that the lease is still the
// current holder of its lock and unexpired by the database clock, and share-locks its
// row until tx ends, so that no takeover, release or reaper sweep changes it before
// tx commits. It is the fencing check of this strategy (etcd's IsOwner compare).
//
// Run it as the last statement of tx, right before COMMIT: the business writes then
// commit only if the lease was current at that point, and the row is locked only
// for the time of the commit. (The share lock also holds the lease's own renewals
// back: a transaction that calls Check early and then runs long can make its own
// lease miss its deadline.) Without sending SQL, it returns an error matching
// sqllock.ErrLost if the lease was lost or passed its local deadline, and
// sqllock.ErrNotHeld if it was released; after the statement, ErrLost if the lease
// is not current.
//
// Check cannot retry a deadlock, serialization failure or lock wait timeout: it runs
// in the caller's transaction, which the database has then aborted (PostgreSQL, and
// MySQL on a deadlock) or in which only the statement failed (MySQL lock wait
// timeout). It returns such an error as a *sqllock.Error whose cause is the driver's
// error: roll tx back and retry the whole transaction. On MySQL, tx should be READ
// COMMITTED or REPEATABLE READ (locking reads see the latest row either way).
func (le *Lease) Check(ctx context.Context, tx *sql.Tx) error {
	return rowlease.Check(ctx, le.core, tx, le.l.b.Pick(checkPostgres, checkMySQL), le.key, le.owner, le.token)
}

// Release gives the lock up: it deletes the lease row if it is still this lease's (or
// gives one hold back, for a re-entered lock). It returns an error matching
// sqllock.ErrLost if the lease had been lost, and nil when called again. It gives the
// lock back even if ctx has already ended (bounded by its own short timeout), so
// that a caller whose context expired does not leave the lock held for a whole TTL.
//
// A transient error (deadlock, serialization failure, lock wait timeout, for example
// against a concurrent sweep or a transaction holding Check's share lock) is retried
// up to 5 times with a short jittered backoff. If the row still cannot be deleted,
// Release returns a *sqllock.Error wrapping the last error: the lease has ended on
// the client, and the row stays until it expires by the database clock, at most the
// TTL after the last renewal, when the next acquirer takes it over.
func (le *Lease) Release(ctx context.Context) error { return le.core.Release(ctx) }

// keeper is the lease's side of the lease core.
type keeper struct{ le *Lease }

func (k keeper) KeepAlive(ctx context.Context) (time.Duration, error) {
	le, b := k.le, k.le.l.b
	onRetry := func(err error) { le.l.transient("keepalive", err) }
	return rowlease.Renewed(b.Kept(ctx, le.turn, onRetry, b.Pick(renewPostgres, renewMySQL), renewArgs(b.Dialect, le.key, le.owner, le.token, le.ttl)...))
}

// renewArgs are the arguments of renewPostgres or renewMySQL.
func renewArgs(d sqllock.Dialect, key, owner []byte, token int64, ttl time.Duration) []any {
	if d == sqllock.Postgres {
		return []any{key, owner, token, ttl.Microseconds()}
	}
	return []any{ttl.Microseconds(), key, owner, token}
}

func (k keeper) GiveBack(ctx context.Context, lost bool) error {
	le := k.le
	var n int64
	err := le.l.retryTransient(ctx, "release", func() (err error) {
		n, err = le.delete(ctx)
		return err
	})
	le.turn.Leave(ctx) // gives the line lock back unless the release did
	return rowlease.Released(n, err, lost, "the lease row")
}

// delete removes the row, or gives back one hold of a reentrant lease (one statement,
// then a best-effort DELETE after the last hold, see unholdPostgres).
func (le *Lease) delete(ctx context.Context) (int64, error) {
	pg := le.l.b.Dialect == sqllock.Postgres
	if le.reentrant {
		var n, freed int64
		if pg {
			var s sql.NullString
			if err := le.l.b.DB.QueryRowContext(ctx, unholdPostgres, le.key, le.owner, le.token).Scan(&n, &freed, &s); err != nil {
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
		if freed > 0 && pg {
			// The last hold: the row is expired, so free already; delete it, best
			// effort. (On MySQL the row stays, freed: see acquireMySQL.)
			le.l.exec(ctx, unholdDonePostgres, le.key, le.owner, le.token)
		}
		return n, nil
	}
	if t := le.turn; t.In() && !t.Dirty() {
		n, err := le.releaseInLine(ctx)
		if err == nil || !t.Dirty() {
			return n, err
		}
		// The turn's session failed (cut, or ended by the server): release through
		// the pool; Leave discards the session, which frees the line lock.
	}
	// Exec, on both: the answer is in the row count (PostgreSQL: one row per
	// deleted row, two for a row that was waited for) or the insert id (MySQL:
	// whether someone waits in the line), and unlike a query with a context, it
	// starts no goroutine of database/sql's.
	if pg {
		res, err := le.l.exec(ctx, releasePostgres, le.key, le.owner, le.token)
		if err != nil {
			return 0, err
		}
		n, err := res.RowsAffected()
		if n > 1 {
			le.l.sawContention(le.key)
			n = 1
		}
		return n, err
	}
	res, err := le.l.exec(ctx, releaseMySQL, le.key, le.key, le.owner, le.token)
	if err != nil {
		return 0, err
	}
	if inLine, err := res.LastInsertId(); err == nil && inLine == 1 {
		le.l.sawContention(le.key)
	}
	return res.RowsAffected()
}

// releaseInLine is the release on the session of the line's turn that got the lock:
// the same statement, which also gives the line lock back once the row is locked.
// A session that fails here is discarded (Leave), which frees the line lock too.
func (le *Lease) releaseInLine(ctx context.Context) (int64, error) {
	t := le.turn
	var n int64
	err := t.Run(ctx, "uniqueindex release", func(qctx context.Context, conn *sql.Conn) error {
		if le.l.b.Dialect == sqllock.Postgres {
			var notified sql.NullString
			var unlocked, inLine bool
			var reset string
			err := conn.QueryRowContext(qctx, releaseLinePostgres, le.key, le.owner, le.token).
				Scan(&n, &notified, &unlocked, &inLine, &reset)
			if err == nil {
				t.Released(unlocked, inLine)
			}
			return err
		}
		q := fmt.Sprintf(releaseLineMySQL, namekey.MySQLHex(le.key), namekey.MySQLHex(le.owner), le.token, le.l.b.Line.MyRelease(namekey.MySQLHex(le.key)))
		res, err := conn.ExecContext(qctx, q)
		if err != nil {
			return err
		}
		v, err := res.LastInsertId()
		if err != nil {
			return err
		}
		if unlocked, inLine, ok := wait.MyReleased(v); ok {
			n = 1
			t.Released(unlocked, inLine)
		}
		return nil
	})
	return n, err
}

// observed returns the lease's core and token, for the lease core's telemetry.
func (le *Lease) observed() (*lease.Lease, int64) { return le.core, le.Token() }
