package optimistic

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

// Lease is a held optimistic lock. Its methods are safe for concurrent use.
type Lease struct {
	l          *Locker
	name       string
	key, owner []byte
	version    int64
	reentrant  bool
	ttl        time.Duration
	core       *lease.Lease
	// turn is the server-side line's turn that got the lock, or nil: its session holds
	// the line lock until the release statement gives it back (GiveBack).
	turn *wait.Turn
}

func (l *Locker) newLease(name string, key, owner []byte, version int64, tm lease.Timing, reentrant bool, granted time.Time, slot *wait.Slot, turn *wait.Turn) *Lease {
	le := &Lease{l: l, name: name, key: key, owner: owner, version: version, reentrant: reentrant, ttl: tm.TTL, turn: turn}
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

// Token returns the fencing token: the row's version after this acquisition's
// compare-and-swap, strictly greater than every earlier acquisition's. Reentrant
// holds share the version of the hold they join.
func (le *Lease) Token() int64 { return le.version }

// Done is closed when the lease is released or lost. A passed local deadline closes
// it at once, whoever looks first.
func (le *Lease) Done() <-chan struct{} { return le.core.Done() }

// Err is nil while held, then matches sqllock.ErrLost or sqllock.ErrNotHeld.
func (le *Lease) Err() error { return le.core.Err() }

// Refresh renews the lease now (a compare-and-swap on the held version). It returns
// an error matching sqllock.ErrLost if the row was taken over or expired (the lease
// then ends), sqllock.ErrNotHeld after Release, and a *sqllock.Error carrying the
// database error if it could not tell: the lease is then still held, and the
// keep-alive goes on.
func (le *Lease) Refresh(ctx context.Context) error { return le.core.Refresh(ctx) }

// Check verifies, inside the caller's transaction tx, that the lease is still the
// current holder of its lock (the row's version and owner are the lease's) and
// unexpired by the database clock, and share-locks the row until tx ends, so that no
// takeover happens before tx commits: the fencing check of this strategy. Run it as
// the last statement of tx, right before COMMIT: the row is then locked only for the
// time of the commit. Without sending SQL, it returns an error matching
// sqllock.ErrLost if the lease was lost or passed its local deadline (and
// sqllock.ErrNotHeld after Release); after the statement, ErrLost if the lease is not
// current. A deadlock or lock wait timeout is returned as a *sqllock.Error carrying
// the driver's error: roll tx back and retry the whole transaction.
func (le *Lease) Check(ctx context.Context, tx *sql.Tx) error {
	return rowlease.Check(ctx, le.core, tx, le.l.b.Pick(checkPostgres, checkMySQL), le.key, le.version, le.owner)
}

// Release gives the lock up (one hold of a re-entered lock): a compare-and-swap that
// frees the row if it is still this lease's. It returns an error matching
// sqllock.ErrLost if the lease had been lost, and nil when called again. It gives
// the lock back even if ctx has already ended (bounded by its own short timeout).
func (le *Lease) Release(ctx context.Context) error { return le.core.Release(ctx) }

// keeper is the lease's side of the lease core.
type keeper struct{ le *Lease }

func (k keeper) KeepAlive(ctx context.Context) (time.Duration, error) {
	le, b := k.le, k.le.l.b
	return rowlease.Renewed(b.Kept(ctx, le.turn, nil, b.Pick(renewPostgres, renewMySQL), renewArgs(b.Dialect, le.key, le.version, le.owner, le.ttl)...))
}

// renewArgs are the arguments of renewPostgres or renewMySQL.
func renewArgs(d sqllock.Dialect, key []byte, version int64, owner []byte, ttl time.Duration) []any {
	if d == sqllock.Postgres {
		return []any{key, version, owner, ttl.Microseconds()}
	}
	return []any{ttl.Microseconds(), key, version, owner}
}

func (k keeper) GiveBack(ctx context.Context, lost bool) error {
	le := k.le
	var n, left int64
	err := wait.Retry(ctx, func() (err error) {
		n, left, err = le.release(ctx)
		return err
	}, nil)
	le.turn.Leave(ctx) // gives the line lock back unless the release did
	if err := rowlease.Released(n, err, lost, "lease row"); err != nil || lost {
		return err
	}
	if left == 0 {
		le.l.rememberVersion(le.key, le.version)
	}
	return nil
}

// release gives one hold back: n is the rows found (0 or 1), left the holds left.
// Through the session of the line's turn that got the lock, if any, which gives the
// line lock back in the same statement; otherwise through the pool. Either way a
// release that finds someone waiting in the line makes the Locker's next
// acquisition of the name wait in line at once.
func (le *Lease) release(ctx context.Context) (n, left int64, err error) {
	l := le.l
	if t := le.turn; t.In() && !t.Dirty() {
		err = t.Run(ctx, "optimistic release", func(qctx context.Context, conn *sql.Conn) error {
			if l.b.Dialect == sqllock.Postgres {
				var unlocked, inLine bool
				var notified sql.NullString
				if err := conn.QueryRowContext(qctx, releaseLinePostgres, le.key, le.version, le.owner).
					Scan(&n, &unlocked, &inLine, &notified); err != nil {
					return err
				}
				t.Released(unlocked, inLine)
				return nil
			}
			q := fmt.Sprintf(releaseLineMySQL, namekey.MySQLHex(le.key), le.version, namekey.MySQLHex(le.owner), l.b.Line.MyRelease(namekey.MySQLHex(le.key)))
			r, err := conn.ExecContext(qctx, q)
			if err != nil {
				return err
			}
			v, err := r.LastInsertId()
			if err != nil {
				return err
			}
			if unlocked, inLine, ok := wait.MyReleased(v % 8); ok {
				n, left = 1, v/8
				t.Released(unlocked, inLine)
			}
			return nil
		})
		if err == nil || !t.Dirty() {
			return n, left, err
		}
		// The turn's session failed (cut, or ended by the server): release through
		// the pool; Leave discards the session, which frees the line lock.
	}
	if l.b.Dialect == sqllock.Postgres {
		// An Exec: unlike a query with a context, it starts no goroutine of
		// database/sql's. Rows: 0 not found, 1 holds left, 2 freed, 3 freed and
		// someone waits in line.
		res, err := l.b.Stmts.Exec(ctx, releasePostgres, le.key, le.version, le.owner)
		if err != nil {
			return 0, 0, err
		}
		rows, err := res.RowsAffected()
		if rows == 3 {
			l.b.Line.Saw(string(le.key))
		}
		n = min(rows, 1)
		if rows == 1 {
			left = 1
		}
		return n, left, err
	}
	res, err := l.b.Stmts.Exec(ctx, releaseMySQL, le.key, le.key, le.version, le.owner)
	if err != nil {
		return 0, 0, err
	}
	if n, err = res.RowsAffected(); err != nil {
		return 0, 0, err
	}
	v, err := res.LastInsertId()
	if v%2 == 1 {
		l.b.Line.Saw(string(le.key))
	}
	return n, v / 2, err
}

// observed returns the lease's core and token, for the lease core's telemetry.
func (le *Lease) observed() (*lease.Lease, int64) { return le.core, le.Token() }
