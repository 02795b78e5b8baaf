package fairqueue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/wait"
)

// Lease is a held fairqueue lock (or semaphore permit): a live ticket among the
// lowest of its name. Its methods are safe for concurrent use.
type Lease struct {
	*ticket
	done     chan struct{} // closed when this hold was released or the ticket ended
	mu       sync.Mutex
	released bool
}

// ticket is one drawn ticket, shared by the reentrant holds of one owner key.
type ticket struct {
	l          *Locker
	name       string
	key, owner []byte
	number     int64
	ttl        time.Duration
	core       *lease.Lease
	ownerKey   string // set under Locker.mu for a reentrant lease
	// grantee is the ticket that the release of this one made a holder, or 0
	// (PostgreSQL, see releasePostgresSQL).
	grantee atomic.Int64
	// turnMu guards turn and gaveBack. turn is the MySQL turn whose session holds the
	// ticket's lock, for a ticket that waited in the line (see waitTurn), or nil;
	// handed over once waitTurn is done with it: the renewals then run on that
	// session, and the give-back gives the lock back. gaveBack: the give-back ran (a
	// lease lost while it waited): a turn handed over later is given up at once.
	turnMu   sync.Mutex
	turn     *wait.Turn
	gaveBack bool

	mu    sync.Mutex
	holds map[*Lease]bool // holds not yet released
	ended bool
}

func (l *Locker) newLease(name string, key, owner []byte, number int64, tm lease.Timing, granted time.Time) *Lease {
	t := &ticket{l: l, name: name, key: key, owner: owner, number: number, ttl: tm.TTL, holds: map[*Lease]bool{}}
	first := &Lease{ticket: t, done: make(chan struct{})}
	t.holds[first] = true
	t.core = lease.Prepare(keeper{t}, lease.Params{
		Timing:  tm,
		Granted: granted,
		Label:   l.b.Cfg.Label("fairqueue", l.b.Dialect, name),
		Log:     l.b.Cfg.Logger,
		Now:     l.b.Now,
		OnEnd: func() {
			l.disown(t)
			t.mu.Lock()
			t.ended = true
			for h := range t.holds {
				h.end()
			}
			t.mu.Unlock()
			// The successor in this process need not wait for the NOTIFY (or, on MySQL,
			// its poll); the grantee the release named goes in without a look.
			topics := []string{wait.Topic(key, strconv.FormatInt(number, 10))}
			if g := t.grantee.Load(); g != 0 {
				topics = append(topics, wait.Topic(key, grantEvent(g)))
			}
			l.b.Hub.Publish(topics...)
		},
	})
	t.core.Run()
	return first
}

// end closes the hold's Done channel, once.
func (le *Lease) end() {
	le.mu.Lock()
	defer le.mu.Unlock()
	select {
	case <-le.done:
	default:
		close(le.done)
	}
}

// Name returns the lock name.
func (le *Lease) Name() string { return le.name }

// Token returns the fencing token: the lease's ticket. Tickets of a name are drawn
// in increasing order and granted in that order, so tokens strictly increase with
// every grant, across restarts (the dispenser is a row that is never deleted).
// Reentrant holds share the ticket of the hold they join.
func (le *Lease) Token() int64 { return le.number }

// Ticket returns the lease's ticket (its token), for operators and tests.
func (le *Lease) Ticket() int64 { return le.number }

// Done is closed when the lease is released or lost. A passed local deadline closes
// it at once, whoever looks first.
func (le *Lease) Done() <-chan struct{} {
	le.core.Done() // looks at the deadline
	return le.done
}

// Err is nil while held, then matches sqllock.ErrLost or sqllock.ErrNotHeld.
func (le *Lease) Err() error {
	le.mu.Lock()
	released := le.released
	le.mu.Unlock()
	err := le.core.Err()
	if released && err == nil {
		return le.core.Label().Err("release", sqllock.ErrNotHeld, nil)
	}
	return err
}

// Refresh renews the ticket now. It returns an error matching sqllock.ErrLost if the
// ticket died (the lease then ends), sqllock.ErrNotHeld after Release, and a
// *sqllock.Error carrying the database error if it could not tell.
func (le *Lease) Refresh(ctx context.Context) error { return le.core.Refresh(ctx) }

// Check verifies, inside the caller's transaction tx, that the lease's ticket is
// still live (unexpired by the database clock), and share-locks it until tx ends: no
// successor is granted before tx commits (a successor first deletes the dead tickets
// ahead of it, which waits for this lock). Run it as the last statement of tx, right
// before COMMIT. Without sending SQL, it returns an error matching sqllock.ErrLost if
// the lease was lost or passed its local deadline (sqllock.ErrNotHeld after
// Release); after the statement, ErrLost if the ticket is dead.
func (le *Lease) Check(ctx context.Context, tx *sql.Tx) error {
	if err := le.Err(); err != nil {
		return err
	}
	return rowlease.Check(ctx, le.core, tx, le.l.b.Pick(checkPostgres, checkMySQL), le.key, le.number, le.owner)
}

// Release gives the lock up (one hold of a re-entered lock; the last deletes the
// ticket, which lets the successor in). It returns an error matching sqllock.ErrLost
// if the lease had been lost, and nil when called again. It deletes the ticket even
// if ctx has already ended (bounded by its own short timeout).
func (le *Lease) Release(ctx context.Context) error {
	le.mu.Lock()
	if le.released {
		le.mu.Unlock()
		return nil
	}
	le.released = true
	le.mu.Unlock()
	t := le.ticket
	t.mu.Lock()
	delete(t.holds, le)
	last := len(t.holds) == 0
	t.mu.Unlock()
	if !last {
		le.end()
		if err := t.core.Err(); errors.Is(err, sqllock.ErrLost) {
			return err
		}
		return nil
	}
	t.l.disown(t)
	err := t.core.Release(ctx)
	le.end()
	return err
}

// addHold re-enters the ticket (the caller holds Locker.mu), or returns nil if its
// last hold was released meanwhile.
func (t *ticket) addHold() *Lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.holds) == 0 || t.ended {
		return nil
	}
	le := &Lease{ticket: t, done: make(chan struct{})}
	t.holds[le] = true
	return le
}

// keeper is the ticket's side of the lease core.
type keeper struct{ le *ticket }

func (k keeper) KeepAlive(ctx context.Context) (time.Duration, error) {
	t, b := k.le, k.le.l.b
	us := t.ttl.Microseconds()
	if b.Dialect == sqllock.Postgres {
		return rowlease.Renewed(b.Changed(ctx, nil, renewPostgres, t.key, t.number, t.owner, us))
	}
	t.turnMu.Lock()
	tn := t.turn
	t.turnMu.Unlock()
	return rowlease.Renewed(b.Kept(ctx, tn, nil, renewMySQL, us, t.key, t.number, t.owner))
}

// handTurn gives the ticket the turn its wait leaves (see turn), or, if the
// ticket's give-back already ran, gives the turn up (its session's locks with it).
func (t *ticket) handTurn(ctx context.Context, tn *wait.Turn) {
	if tn == nil {
		return
	}
	t.turnMu.Lock()
	if !t.gaveBack {
		t.turn, tn = tn, nil
	}
	t.turnMu.Unlock()
	tn.Leave(ctx)
}

// takeTurn takes the ticket's turn for its give-back: later ones are given up by
// handTurn.
func (t *ticket) takeTurn() *wait.Turn {
	t.turnMu.Lock()
	defer t.turnMu.Unlock()
	t.gaveBack = true
	tn := t.turn
	t.turn = nil
	return tn
}

func (k keeper) GiveBack(ctx context.Context, lost bool) error {
	t, b := k.le, k.le.l.b
	if b.Dialect == sqllock.MySQL {
		if tn := t.takeTurn(); tn != nil {
			n, err := t.releaseInLine(ctx, tn)
			// Gives the ticket lock back unless the release did; a session that failed
			// is discarded, which frees it.
			tn.Leave(ctx)
			if err == nil {
				return rowlease.Released(n, nil, lost, "the ticket")
			}
		}
		// A contended name's ticket is likely not the last.
		n, err := deleteMySQL(b.Line != nil && b.Line.Contended(string(t.key)), func(after bool) (int64, error) {
			if after {
				return b.Changed(ctx, nil, releaseAfterMySQL, t.key, t.number, t.owner, t.key)
			}
			return b.Changed(ctx, nil, releaseMySQL, t.key, t.number, t.owner)
		}, func() error {
			_, err := b.Changed(ctx, nil, bumpMySQL, t.number, t.key)
			return err
		})
		return rowlease.Released(n, err, lost, "the ticket")
	}
	var n, grantee int64
	err := wait.Retry(ctx, func() error {
		var err error
		n, grantee, err = t.l.runRelease(ctx, releaseTicketPostgres, t.key, t.number, t.owner, t.l.permits)
		return err
	}, nil)
	if err == nil {
		t.grantee.Store(grantee) // published when the lease ends, right after
	}
	return rowlease.Released(n, err, lost, "the ticket")
}

// deleteMySQL deletes a ticket on MySQL (see enqueueMySQL) with del: with after set
// (a higher ticket is likely left), first without moving the dispenser on, which
// deletes nothing if no higher ticket is left; then, if need be, once bump moved
// the dispenser past it.
func deleteMySQL(after bool, del func(after bool) (int64, error), bump func() error) (int64, error) {
	if after {
		if n, err := del(true); err != nil || n > 0 {
			return n, err
		}
	}
	if err := bump(); err != nil {
		return 0, err
	}
	return del(false)
}

// releaseInLine deletes the ticket on the session of turn tn, which holds the
// ticket's lock: the statement gives the lock back too (releaseLineMySQLFmt). A
// ticket that waited is seldom the last (deleteMySQL).
func (t *ticket) releaseInLine(ctx context.Context, tn *wait.Turn) (int64, error) {
	k := namekey.MySQLHex(t.key)
	run := func(q string) (n int64, err error) {
		err = tn.Run(ctx, "fairqueue release", func(qctx context.Context, conn *sql.Conn) error {
			res, err := conn.ExecContext(qctx, q)
			if err != nil {
				return err
			}
			n, err = res.RowsAffected()
			return err
		})
		return n, err
	}
	n, err := deleteMySQL(true, func(after bool) (int64, error) {
		cond := ""
		if after {
			cond = fmt.Sprintf(higherLeftMySQLFmt, k)
		}
		return run(fmt.Sprintf(releaseLineMySQLFmt, k, t.number, namekey.MySQLHex(t.owner), cond))
	}, func() error {
		_, err := run(fmt.Sprintf(bumpMySQLFmt, strconv.FormatInt(t.number, 10), k))
		return err
	})
	if err == nil && n > 0 {
		tn.Released(true, false)
	}
	return n, err
}

// observed returns the lease's core and token, for the lease core's telemetry.
func (le *Lease) observed() (*lease.Lease, int64) { return le.core, le.Token() }
