package fairqueue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/internal/wait"
)

// Defaults of the options.
const (
	// DefaultTTL is the lease time of a ticket, waiting or holding: a ticket whose
	// owner stops renewing it is dead after it, and stops blocking its successors.
	DefaultTTL = rowlease.DefaultTTL
	// DefaultPollInterval caps the time a waiter sleeps between two looks at its
	// predecessors when no wake-up comes.
	DefaultPollInterval = rowlease.DefaultPollInterval
	// DefaultAttemptTimeout bounds one statement.
	DefaultAttemptTimeout = rowlease.DefaultAttemptTimeout
	// nextPoll caps the sleep of a MySQL waiter next in line to be granted: MySQL has
	// no notifications, so it looks often (see pace).
	nextPoll = 10 * time.Millisecond
)

// Option configures a Locker. Options are validated by New.
type Option func(*rowlease.Config) error

// WithTTL sets the lease time of the Locker's tickets (DefaultTTL).
// sqllock.WithLeaseTTL overrides it for one acquisition.
func WithTTL(d time.Duration) Option { return func(c *rowlease.Config) error { return c.SetTTL(d) } }

// WithKeepalive sets how often a ticket is renewed (default TTL/3). It must be at
// most half the TTL.
func WithKeepalive(d time.Duration) Option {
	return func(c *rowlease.Config) error { return c.SetInterval(d) }
}

// WithPollInterval caps the sleep of a waiter between two looks at its predecessors
// (DefaultPollInterval).
func WithPollInterval(d time.Duration) Option {
	return func(c *rowlease.Config) error { return c.SetPoll(d) }
}

// WithAttemptTimeout bounds each statement the Locker sends (DefaultAttemptTimeout),
// and never more than what is left of the caller's context.
func WithAttemptTimeout(d time.Duration) Option {
	return func(c *rowlease.Config) error { return c.SetAttempt(d) }
}

// WithLogger sets the logger of lease losses and listener errors (default: none).
func WithLogger(l *slog.Logger) Option {
	return func(c *rowlease.Config) error { return c.SetLogger(l) }
}

// WithTelemetryNames records lock names in the OpenTelemetry spans (default: a hash
// of the name, since names can carry user data).
func WithTelemetryNames() Option {
	return func(c *rowlease.Config) error { return c.SetTelemetryNames() }
}

// WithRequireSyncReplication makes the Locker refuse (an error matching
// sqllock.ErrUnsafeDeployment from its first acquisition) a PostgreSQL primary whose
// standbys replicate asynchronously, or a MySQL source whose replicas do (no
// semi-synchronous replication, one that waits AFTER_COMMIT, or one fallen back to
// asynchronous), where a failover can forget granted leases and repeat tokens; and a
// server where it cannot tell (a MySQL user without the REPLICATION SLAVE privilege,
// MariaDB's REPLICATION MASTER ADMIN, cannot list the replicas, unless lossless
// semi-synchronous replication is in force). Without it the Locker logs one warning
// and goes on.
func WithRequireSyncReplication() Option {
	return func(c *rowlease.Config) error { return c.SetRequireSyncReplication() }
}

// Locker acquires fairqueue locks (or, from NewSemaphore, permits of a counting
// semaphore). It is safe for concurrent use. Close it when done.
type Locker struct {
	b       *rowlease.Locker
	permits int

	mu     sync.Mutex
	owners map[string]*ticket // owner key + "\x00" + lock key -> the held ticket it re-enters
	topped map[string]bool    // MySQL: the lock keys whose top row this Locker added (topMySQL)

	pace pace // MySQL: the time between two grants of a name, as its waiters saw it
}

// New returns a Locker of strictly first-in first-out locks on db, which must have
// been migrated (migrations.Up). It sends no SQL. It returns an error matching
// sqllock.ErrInvalidOption for an invalid dialect or option.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	return NewSemaphore(db, d, 1, opts...)
}

// NewSemaphore returns a Locker whose names are counting semaphores of n permits:
// the n lowest live tickets of a name hold it at once, granted in the order the
// tickets were drawn. Every Locker of a name must use the same n.
func NewSemaphore(db *sql.DB, d sqllock.Dialect, n int, opts ...Option) (*Locker, error) {
	cfg := rowlease.Defaults()
	if err := lease.New("fairqueue", db, d, &cfg, &cfg.Config, opts); err != nil {
		return nil, err
	}
	if n < 1 {
		return nil, lease.NewError("new", d, "", sqllock.ErrInvalidOption, fmt.Errorf("fairqueue: %d permits: need at least 1", n))
	}
	l := &Locker{b: rowlease.New("fairqueue", db, d, cfg, channel), permits: n, owners: map[string]*ticket{}}
	if d == sqllock.MySQL && n == 1 {
		l.b.EnableLine() // see waitTurn
	}
	return l, nil
}

// Permits returns the number of holders a name may have at once (1 for New).
func (l *Locker) Permits() int { return l.permits }

// Close stops the shared PostgreSQL listener and wakes the waiters, which go on by
// polling. Held leases and waiting tickets are not released. Idempotent.
func (l *Locker) Close() error {
	l.b.Close()
	return nil
}

// Holder returns the current holder of name: the lowest live ticket, with the host
// and pid it records, its number (the token) and when it was drawn (Since: the
// holder's place in the queue, before its grant), and the time left of its lease, on
// the database clock. The lowest live ticket may be a waiter whose turn came an
// instant ago. It sends one read statement and takes no lock. It returns an error
// matching sqllock.ErrNoHolder when no live ticket exists, and one matching
// sqllock.ErrUnsupported for a semaphore of more than one permit, which has several
// holders. See sqllock.HolderInspector and sqllock.Leader.
func (l *Locker) Holder(ctx context.Context, name string) (sqllock.Holder, error) {
	if l.permits > 1 {
		return sqllock.Holder{}, l.b.Errorf("holder", name, sqllock.ErrUnsupported,
			fmt.Errorf("a semaphore of %d permits has several holders", l.permits))
	}
	return l.b.Holder(ctx, name, l.b.Pick(holderPostgres, holderMySQL))
}

// Acquire draws a ticket for name and waits until it is among the lowest live
// tickets (the first, for a lock), or until ctx ends, when the ticket is deleted
// before Acquire returns. See sqllock.Locker. sqllock.WithOwner makes the
// acquisition reentrant within this Locker; sqllock.WithLeaseTTL overrides the
// ticket's lease time.
func (l *Locker) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	le, err := l.acquire(ctx, "acquire", name, opts, true)
	if err != nil {
		return nil, err
	}
	return le, nil
}

// TryAcquire draws a ticket and keeps it only if no live ticket is ahead of it (fewer
// than the permits, for a semaphore); otherwise it deletes it and returns an error
// matching sqllock.ErrNotAcquired. It never leaves a ticket behind.
func (l *Locker) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	le, err := l.acquire(ctx, "try-acquire", name, opts, false)
	if err != nil {
		return nil, err
	}
	return le, nil
}

func (l *Locker) acquire(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	return lease.Observed(ctx, l.b.Cfg.Label("fairqueue", l.b.Dialect, name), block, func(ctx context.Context) (*Lease, error) {
		return l.acquireLease(ctx, op, name, opts, block)
	}, (*Lease).observed)
}

func (l *Locker) acquireLease(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	ac, tm, err := l.b.Prelude(ctx, op, name, opts)
	if err != nil {
		return nil, err
	}
	key := namekey.Key(name)
	if ac.Owner != "" {
		if le := l.reenter(ac.Owner, key); le != nil {
			return le, nil
		}
	}
	for {
		le, first, turn, err := l.enqueue(ctx, op, name, key, tm, block)
		if err != nil {
			return nil, err
		}
		granted, err := l.waitTurn(ctx, le, block, first, turn)
		if err == nil && granted {
			if err := lease.Granted(ctx, le.core.Label(), op, le.Release); err != nil {
				return nil, err
			}
			if ac.Owner != "" {
				l.own(ac.Owner, le)
			}
			return le, nil
		}
		if errors.Is(err, errTicketLost) && block && ctx.Err() == nil {
			// The ticket died while waiting (renewals failed past its deadline): it lost
			// its place; draw a new one.
			le.core.Release(ctx)
			continue
		}
		// Not granted: delete the ticket before returning, even if ctx has ended.
		le.core.Release(ctx)
		switch {
		case ctx.Err() != nil:
			return nil, l.b.Errorf(op, name, sqllock.ErrNotAcquired, ctx.Err())
		case err == nil || errors.Is(err, errTicketLost):
			return nil, l.b.Errorf(op, name, sqllock.ErrNotAcquired, errors.New("tickets ahead of it are live"))
		case sqlerr.Transient(err) || wait.OutcomeUnknown(err):
			return nil, l.b.Errorf(op, name, sqllock.ErrNotAcquired, err)
		}
		return nil, l.b.Errorf(op, name, nil, err)
	}
}

var errTicketLost = errors.New("ticket lost while waiting")

// enqueue draws a ticket and starts its keep-alive. It also returns the look at the
// predecessors that the draw answered (PostgreSQL), or nil; and on MySQL, for a lock
// whose name was seen contended, the turn whose session drew the ticket and holds
// its lock (see drawOn), or nil. An enqueue whose outcome is unknown is undone
// (forget) before the error is returned.
func (l *Locker) enqueue(ctx context.Context, op, name string, key []byte, tm lease.Timing, block bool) (*Lease, *look, *wait.Turn, error) {
	owner := l.b.Owner('T', "")
	var ticket int64
	var start time.Time
	var first *look
	var err error
	var turn *wait.Turn
	if block && l.b.Line != nil && l.b.Line.Contended(string(key)) {
		turn = l.b.Line.Take(ctx, key)
	}
	for attempt := 0; ; attempt++ {
		err = wait.Retry(ctx, func() error {
			actx, cancel := l.b.AttemptContext(ctx)
			defer cancel()
			var err error
			if turn != nil {
				if ticket, start, first, err = l.drawOn(actx, turn, key, name, owner, tm.TTL); err == nil {
					return nil
				}
				// The session may hold the lock of a number it did not get: discard it
				// (the server frees what it held), and draw without the line: in the
				// next attempt after a conflict; at once, and never again on this
				// Locker, after the server refused the statement (GET_LOCK unsupported,
				// say); not after an error that leaves the draw's outcome unknown
				// (enqueue forgets the owner's tickets).
				turn.Discard(ctx)
				turn = nil
				if sqlerr.Transient(err) || wait.OutcomeUnknown(err) {
					return err
				}
				l.b.Line.Off("drawing a ticket on a session of the line failed: " + err.Error())
			}
			ticket, start, first, err = l.draw(actx, key, name, owner, tm.TTL)
			return err
		}, nil)
		// An Acquire goes on drawing through conflicts (draws of a busy name on MySQL
		// collide) until its ctx ends.
		if err == nil || !block || !sqlerr.Transient(err) || ctx.Err() != nil {
			break
		}
		if backoff.Sleep(ctx, wait.TransientPolicy.Delay(attempt), nil) != nil {
			break
		}
	}
	if err != nil {
		if wait.OutcomeUnknown(err) {
			l.forget(ctx, key, owner)
		}
		if ctx.Err() != nil {
			return nil, nil, nil, l.b.Errorf(op, name, sqllock.ErrNotAcquired, ctx.Err())
		}
		if sqlerr.Transient(err) {
			return nil, nil, nil, l.b.Errorf(op, name, sqllock.ErrNotAcquired, err)
		}
		return nil, nil, nil, l.b.Errorf(op, name, nil, err)
	}
	return l.newLease(name, key, owner, ticket, tm, start), first, turn, nil
}

// drawOn is the MySQL draw on the session of turn t (enqueueLineMySQLFmt), which then
// holds the lock of the ticket drawn: taken before the ticket is visible, so its
// successors' looks find it held.
func (l *Locker) drawOn(ctx context.Context, t *wait.Turn, key []byte, name string, owner []byte, ttl time.Duration) (int64, time.Time, *look, error) {
	k := namekey.MySQLHex(key)
	q := fmt.Sprintf(enqueueLineMySQLFmt, k, namekey.MySQLHex(owner), ttl.Microseconds(), namekey.MySQLHex([]byte(l.b.Host)), l.b.PID,
		wait.MyTicketName(k, enqueueNumberMySQL))
	ticket, start, first, err := l.drawMySQL(ctx, key, name, func() (res sql.Result, err error) {
		err = t.Run(ctx, "fairqueue draw", func(qctx context.Context, conn *sql.Conn) error {
			res, err = conn.ExecContext(qctx, q)
			return err
		})
		return res, err
	})
	if err == nil {
		t.Entered() // it holds its ticket's lock
	}
	return ticket, start, first, err
}

// drawMySQL runs a MySQL draw statement until the name has a dispenser (it creates
// it), and decodes its answer (see draw). An error, a duplicate key included, is
// returned as is.
func (l *Locker) drawMySQL(ctx context.Context, key []byte, name string, run func() (sql.Result, error)) (int64, time.Time, *look, error) {
	if err := l.top(ctx, key); err != nil {
		return 0, l.b.Now(), nil, err
	}
	for created := false; ; {
		start := l.b.Now()
		res, err := run()
		if err != nil {
			return 0, start, nil, err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return 0, start, nil, err
		}
		if n == 0 && !created {
			if _, err := l.b.Stmts.Exec(ctx, createMySQL, key, []byte(name)); err != nil {
				return 0, start, nil, err
			}
			created = true
			continue
		}
		if n == 0 {
			return 0, start, nil, errors.New("fairqueue: the ticket dispenser of the name is missing")
		}
		id, err := res.LastInsertId()
		if err != nil {
			return 0, start, nil, err
		}
		t, first := drawn(id)
		if t < 1 {
			// No ticket is 0: the insert id did not come through (a proxy?).
			return 0, start, nil, fmt.Errorf("fairqueue: the draw answered insert id %d, no ticket", id)
		}
		return t, start, first, nil
	}
}

// top adds the top row of key (see topMySQL) unless this Locker did already.
func (l *Locker) top(ctx context.Context, key []byte) error {
	l.mu.Lock()
	done := l.topped[string(key)]
	l.mu.Unlock()
	if done {
		return nil
	}
	if _, err := l.b.Stmts.Exec(ctx, topRowMySQL, key); err != nil {
		return err
	}
	l.mu.Lock()
	if l.topped == nil || len(l.topped) >= 4096 {
		l.topped = map[string]bool{}
	}
	l.topped[string(key)] = true
	l.mu.Unlock()
	return nil
}

// drawn decodes a MySQL draw's insert id (enqueueTicketMySQL, an unsigned number):
// the ticket, and the look the draw answered if no other ticket of the name was
// there (else nil).
func drawn(id int64) (int64, *look) {
	u := uint64(id)
	if u%2 == 1 {
		return int64(u / 2), &look{}
	}
	return int64(u / 2), nil
}

// draw inserts a ticket and returns its number, when the statement that set its
// expiry was sent, and the look at its predecessors that the draw's statement made
// (see enqueuePostgres; on MySQL only when there were none, enqueueTicketMySQL), or
// nil.
func (l *Locker) draw(ctx context.Context, key []byte, name string, owner []byte, ttl time.Duration) (int64, time.Time, *look, error) {
	us := ttl.Microseconds()
	start := l.b.Now()
	if l.b.Dialect == sqllock.Postgres {
		// On a connection whose wait is cancelled when ctx ends: a draw whose commit
		// waits for a synchronous standby must not commit after forget looked.
		var t int64
		var lk look
		err := l.b.OnConn(ctx, "fairqueue draw", func(qctx context.Context, conn *sql.Conn) error {
			rows, err := conn.QueryContext(qctx, enqueuePostgres, key, []byte(name), owner, us, l.b.Host, l.b.PID, l.permits)
			if err != nil {
				return err
			}
			return scanRows(rows, func(a, b int64) {
				if a == rowTicket {
					t = b
				} else {
					lk.add(a, b)
				}
			})
		})
		if err == nil && t == 0 {
			err = errors.New("fairqueue: the draw returned no ticket")
		}
		if err != nil {
			return t, start, nil, err
		}
		lk.position = len(lk.preds)
		return t, start, &lk, nil
	}
	t, start, first, err := l.drawMySQL(ctx, key, name, func() (sql.Result, error) {
		return l.b.Stmts.Exec(ctx, enqueueMySQL, key, owner, us, l.b.Host, l.b.PID, key)
	})
	if sqlerr.Is(err, sqlerr.Duplicate) {
		// A concurrent draw took the number first (see enqueueMySQL): draw in a
		// transaction instead, which holds the dispenser until the ticket commits.
		t, start, err := l.drawTx(ctx, key, name, owner, us)
		return t, start, nil, err
	}
	return t, start, first, err
}

// drawTx is the MySQL draw in one transaction, taken when a concurrent draw took
// the dispenser's number first: it locks the dispenser (waiting for the draws under
// way to commit), numbers the ticket past both the dispenser and every ticket there
// is, moves the dispenser on and inserts the ticket, which commit together.
func (l *Locker) drawTx(ctx context.Context, key []byte, name string, owner []byte, us int64) (int64, time.Time, error) {
	tx, err := l.b.DB.BeginTx(ctx, nil)
	if err != nil {
		return 0, time.Time{}, err
	}
	defer tx.Rollback()
	var next, highest int64
	if err := tx.QueryRowContext(ctx, drawTxLockMySQL, key).Scan(&next); err != nil {
		return 0, time.Time{}, err
	}
	if err := tx.QueryRowContext(ctx, drawTxHighestMySQL, key).Scan(&highest); err != nil {
		return 0, time.Time{}, err
	}
	ticket := max(next, highest+1)
	if _, err := tx.ExecContext(ctx, bumpMySQL, ticket, key); err != nil {
		return 0, time.Time{}, err
	}
	start := l.b.Now()
	if _, err := tx.ExecContext(ctx, drawTxTicketMySQL, key, ticket, owner, us, l.b.Host, l.b.PID); err != nil {
		return 0, start, err
	}
	return ticket, start, tx.Commit()
}

// waitTurn waits until le's ticket is among the lowest live tickets of its name (the
// permits), watching only its nearest predecessors: it wakes when one of them is
// released (a NOTIFY with its ticket on PostgreSQL, a release in this process), when
// the release that made it a holder names its ticket (then it is granted without a
// statement), when the nearest one's lease would expire (a dead owner), or after a
// poll. first is the look its draw answered, or nil; turn the turn whose session
// drew the ticket, or nil. With block false it looks once. It returns errTicketLost
// if the ticket died meanwhile.
//
// On MySQL, which has no notifications, a lock's waiter found contended waits in the
// server instead of polling (see enterLine): its session holds a lock named after
// its ticket (wait.MyTicketName) until its release, and its look waits for the lock
// of its nearest predecessor, which that one's release statement gives back. So
// each waiter waits for its predecessor, as on PostgreSQL, and sends one statement
// per predecessor that goes. These locks are a waiting aid only: the tickets decide
// who holds the lock. A predecessor whose lock is free while it is live (it waits
// without one: no turn was to be had, or it was granted without waiting) is polled
// for as before.
func (l *Locker) waitTurn(ctx context.Context, le *Lease, block bool, first *look, turn *wait.Turn) (granted bool, err error) {
	seen := new(sighting)
	lk := first
	lw := lineWait{turn: turn}
	defer func() {
		// The release deletes the ticket and gives its lock back in one statement on
		// the turn's session, granted or not.
		le.handTurn(ctx, lw.turn)
	}()
	enter := block && l.b.Line != nil && (turn != nil || l.b.Line.Contended(string(le.key)))
	for attempt := 0; ; attempt++ {
		if le.core.Err() != nil {
			return false, errTicketLost
		}
		var err error
		lw.entered = false
		if lk == nil && enter && !lw.off {
			if lk, err = l.enterLine(ctx, le, &lw); lk == nil && err == nil && le.core.Err() != nil {
				return false, errTicketLost
			}
		}
		if lk == nil && err == nil {
			lk, err = l.predecessors(ctx, le)
		}
		if err == nil && l.b.Dialect == sqllock.MySQL {
			l.pace.saw(le.key, seen, lk.position, time.Now())
		}
		if err == nil && lk.position < l.permits {
			if lk.dead {
				// Drop the dead tickets first: this waits for a Check a dead holder's
				// transaction may still hold on its ticket.
				err = l.dropDead(ctx, le)
			}
			if err == nil {
				if le.core.Err() != nil {
					return false, errTicketLost
				}
				return true, nil
			}
		}
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return false, ctx.Err()
		case sqlerr.Transient(err) || wait.OutcomeUnknown(err):
			if !block {
				return false, err
			}
		default:
			return false, err
		}
		if !block {
			return false, nil
		}
		if l.b.Line != nil && err == nil {
			l.b.Line.Saw(string(le.key))
			if len(lk.preds) > 0 {
				lw.pred = lk.preds[0].ticket
			}
			if !enter || (lw.entered && (lw.frees == 0 || lk.position > 1 && lw.frees == 1)) {
				// Contended: wait in the server from now on; or the predecessor it
				// waited for went: wait for the next one. At once; also once when a
				// predecessor that waits did not hold its lock yet (a Locker's first
				// waiter of a name takes it in its first entry, after its draw).
				enter, lk = true, nil
				continue
			}
		}
		var preds []pred
		place := 1
		if lk != nil {
			preds, place = lk.preds, lk.position-l.permits+1
		}
		longest := time.Duration(0)
		if lw.turn != nil {
			// The turn's session is ended by the server once idle for the TTL: look
			// (a statement on it) before that.
			longest = le.ttl / 3
		}
		granted, err := l.sleep(ctx, le, preds, seen, place, attempt, err != nil, longest)
		if err != nil {
			return false, err
		}
		if granted {
			if le.core.Err() != nil {
				return false, errTicketLost
			}
			return true, nil
		}
		lk = nil
	}
}

// lineWait is a waiter's use of the MySQL ticket locks (see waitTurn).
type lineWait struct {
	turn    *wait.Turn // its turn, whose session holds its ticket lock once it entered
	pred    int64      // the predecessor whose lock the next entry waits for (0: the ticket below its own)
	entered bool       // the last entry waited for its predecessor's lock and got it
	// frees counts the entries in a row that got their predecessor's lock while the
	// predecessor was live (it does not hold its lock).
	frees int
	off   bool // an entry failed: this acquisition waits without the line
}

// enterLine makes le's next look on MySQL in the line (lineLookMySQLFmt), on the
// session of a turn (taken if lw has none): it takes le's ticket lock (if free) and
// waits for its predecessor's. It returns nil and no error when the look is to be
// made without the line: no turn was to be had, the wait ran out (the predecessor
// holds on), or the entry failed (this acquisition then waits without the line).
func (l *Locker) enterLine(ctx context.Context, le *Lease, lw *lineWait) (*look, error) {
	if lw.turn == nil {
		if lw.turn = l.b.Line.Take(ctx, le.key); lw.turn == nil {
			return nil, nil
		}
	}
	t := lw.turn
	p := lw.pred
	if p == 0 {
		p = le.number - 1
	}
	actx, cancel, w := l.b.Line.EntryContext(ctx, l.b.Cfg.Attempt)
	defer cancel()
	// A ticket lost while it waits (its renewals failed for a TTL) has been deleted:
	// stop waiting at once (the session, discarded, gives its lock to the successor).
	go func() {
		select {
		case <-le.core.Done():
			cancel()
		case <-actx.Done():
		}
	}()
	k := namekey.MySQLHex(le.key)
	predName := wait.MyTicketName(k, strconv.FormatInt(p, 10))
	q := fmt.Sprintf(lineLookMySQLFmt, wait.MyTicketName(k, strconv.FormatInt(le.number, 10)), wait.MyEnter(predName, w), k, le.number, predName)
	var joined, nearest, live, dead, left, gaveBack int64
	err := t.Run(actx, "fairqueue line", func(qctx context.Context, conn *sql.Conn) error {
		return conn.QueryRowContext(qctx, q).Scan(&joined, &nearest, &live, &dead, &left, &gaveBack)
	})
	if err != nil {
		// The session may hold locks or not: discard it (the server frees what it
		// held).
		t.Discard(ctx)
		lw.turn = nil
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if !sqlerr.Transient(err) {
			lw.off = true
			l.b.Cfg.Logger.Debug("sqllock/fairqueue: entering the server-side line failed; waiting without it", "err", err)
			if !wait.OutcomeUnknown(err) {
				l.b.Line.Off("entering the line failed: " + err.Error())
			}
		}
		return nil, nil
	}
	t.Entered() // it holds its ticket lock
	if joined == 0 {
		return nil, nil
	}
	lw.entered = true
	if nearest == p {
		lw.frees++
	} else {
		lw.frees = 0
	}
	lk := &look{position: int(live), dead: dead > 0}
	if nearest > 0 {
		lk.preds = []pred{{nearest, time.Duration(left) * time.Microsecond}}
	}
	return lk, nil
}

// pred is a live predecessor: its ticket and its remaining lease.
type pred struct {
	ticket int64
	left   time.Duration
}

// look is what a waiter saw of the tickets below its own.
type look struct {
	preds    []pred // the nearest live ones, at most the permits
	position int    // how many live tickets are below it (granted below the permits)
	dead     bool   // a dead one is below it
}

// add records a row of a look: a live predecessor (ticket, remaining µs), the
// position (-1, n) or the marker of a dead one (0, -1).
func (lk *look) add(t, us int64) {
	switch {
	case t == 0 && us == -1:
		lk.dead = true
	case t == -1:
		lk.position = int(us)
	default:
		lk.preds = append(lk.preds, pred{t, time.Duration(us) * time.Microsecond})
	}
}

// scanRows calls f with each row of two integers, and closes rows.
func scanRows(rows *sql.Rows, f func(a, b int64)) error {
	defer rows.Close()
	for rows.Next() {
		var a, b int64
		if err := rows.Scan(&a, &b); err != nil {
			return err
		}
		f(a, b)
	}
	return rows.Err()
}

// predecessors looks, in a statement of its own, at the tickets below le's: the
// nearest live ones (at most the permits), how many live ones are below it (its
// position: granted below the permits; on PostgreSQL the live ones it returns, which
// is all the position tells there), and whether a dead one is below it.
func (l *Locker) predecessors(ctx context.Context, le *Lease) (*look, error) {
	actx, cancel := l.b.AttemptContext(ctx)
	defer cancel()
	var rows *sql.Rows
	var err error
	if l.b.Dialect == sqllock.Postgres {
		rows, err = l.b.Stmts.Query(actx, predecessorsPostgres, le.key, le.number, l.permits)
	} else {
		rows, err = l.b.Stmts.Query(actx, predecessorsMySQL, le.key, le.number, l.permits, le.key, le.number, le.key, le.number)
	}
	if err != nil {
		return nil, err
	}
	lk := new(look)
	if err := scanRows(rows, lk.add); err != nil {
		return nil, err
	}
	if l.b.Dialect == sqllock.Postgres {
		lk.position = len(lk.preds)
	}
	return lk, nil
}

func (l *Locker) dropDead(ctx context.Context, le *Lease) error {
	actx, cancel := l.b.AttemptContext(ctx)
	defer cancel()
	q := dropDeadMySQL
	if l.b.Dialect == sqllock.Postgres {
		q = dropDeadPostgres
	}
	return wait.Retry(actx, func() error {
		_, err := l.b.Stmts.Exec(actx, q, le.key, le.number)
		return err
	}, nil)
}

// grantEvent is the event of the grant of ticket: its topic is published when the
// release that made it a holder names it (the NOTIFY payload, see releasePostgresSQL, or
// a release in this process).
func grantEvent(ticket int64) string { return "g" + strconv.FormatInt(ticket, 10) }

// sleep waits for the release of one of preds (their topics), the grant of le's
// ticket, the nearest one's expiry, a poll (at most longest, if set), the ticket's own
// loss, or ctx. It reports whether le's ticket was granted.
func (l *Locker) sleep(ctx context.Context, le *Lease, preds []pred, seen *sighting, place, attempt int, failed bool, longest time.Duration) (bool, error) {
	wake := make(chan struct{}, 1)
	grant := wait.Topic(le.key, grantEvent(le.number))
	topics := make([]string, len(preds), len(preds)+1)
	for i, p := range preds {
		topics[i] = wait.Topic(le.key, strconv.FormatInt(p.ticket, 10))
	}
	defer l.b.Hub.SubscribeTopics(wake, append(topics, grant)...)()
	// The fallback: the nearest predecessors' expiry (a dead owner releases nothing),
	// at most the poll interval. On MySQL, which has no notifications, see pace.sleep.
	d := backoff.Policy{Min: l.b.Cfg.Poll / 2, Max: l.b.Cfg.Poll}.Delay(1)
	switch {
	case failed:
		d = backoff.Policy{Min: time.Millisecond, Max: l.b.Cfg.Poll}.Delay(attempt)
	case l.b.Dialect == sqllock.MySQL:
		d = l.pace.sleep(le.key, seen, place, l.b.Cfg.Poll)
	default:
		l.b.Hub.Listen()
	}
	for _, p := range preds {
		if p.left > 0 && p.left+time.Millisecond < d {
			d = p.left + time.Millisecond
		}
	}
	if longest > 0 {
		d = min(d, longest)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false, ctx.Err()
	case <-wake:
	case <-le.core.Done():
	case <-t.C:
	}
	// The topics of one NOTIFY are published together: woken by the release, the
	// grantee finds its grant published.
	return l.b.Hub.Published(grant), nil
}

// forget deletes the tickets an enqueue of owner may have left without the caller
// learning of it. Best effort, bounded by the attempt timeout: a ticket left behind
// dies after its TTL.
func (l *Locker) forget(ctx context.Context, key, owner []byte) {
	// No probe: the tickets of an owner are never another holder's, nothing locks
	// them but their owner.
	wait.Forget(ctx, min(lease.GiveBackTimeout, l.b.Cfg.Attempt), nil, func(ctx context.Context) error {
		if l.b.Dialect == sqllock.Postgres {
			_, _, err := l.runRelease(ctx, forgetPostgres, key, owner, l.permits)
			return err
		}
		if _, err := l.b.Stmts.Exec(ctx, bumpOwnerMySQL, key, owner, key); err != nil {
			return err
		}
		_, err := l.b.Stmts.Exec(ctx, forgetMySQL, key, owner)
		return err
	}, l.b.Cfg.Logger)
}

// runRelease runs a release statement of PostgreSQL (releaseTicketPostgres,
// forgetPostgres) once, and returns how many tickets it deleted and the ticket it
// made a holder, or 0.
func (l *Locker) runRelease(ctx context.Context, q string, args ...any) (n, grantee int64, err error) {
	rows, err := l.b.Stmts.Query(ctx, q, args...)
	if err != nil {
		return 0, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var ticket int64
		var g sql.NullInt64
		var notified bool
		if err := rows.Scan(&ticket, &g, &notified); err != nil {
			return 0, 0, err
		}
		n++
		grantee = max(grantee, g.Int64)
	}
	return n, grantee, rows.Err()
}

// reenter adds a hold to the ticket an owner key holds on key through this Locker.
func (l *Locker) reenter(owner string, key []byte) *Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	t := l.owners[owner+"\x00"+string(key)]
	if t == nil || t.core.Err() != nil {
		return nil
	}
	return t.addHold()
}

func (l *Locker) own(owner string, le *Lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := owner + "\x00" + string(le.key)
	le.ownerKey = k
	l.owners[k] = le.ticket
}

func (l *Locker) disown(t *ticket) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if t.ownerKey != "" && l.owners[t.ownerKey] == t {
		delete(l.owners, t.ownerKey)
	}
}

// Sweeper deletes dead tickets for the reaper package (it implements
// reaper.Sweeper).
type Sweeper struct {
	db      *sql.DB
	dialect sqllock.Dialect
	grace   time.Duration
}

// NewSweeper returns the Sweeper of the ticket table: each batch deletes tickets
// dead (expired by the database clock) for more than grace, never waiting for a
// lock. The dispensers (sqllock_queue) are kept: they make the tokens.
func NewSweeper(db *sql.DB, d sqllock.Dialect, grace time.Duration) (*Sweeper, error) {
	if db == nil || !d.Valid() || grace < 0 {
		return nil, lease.NewError("new-sweeper", d, "", sqllock.ErrInvalidOption,
			fmt.Errorf("need a *sql.DB, a valid dialect and a grace period >= 0 (got %v)", grace))
	}
	return &Sweeper{db: db, dialect: d, grace: grace}, nil
}

// Name returns "sqllock_ticket".
func (s *Sweeper) Name() string { return "sqllock_ticket" }

// SweepBatch deletes at most limit dead tickets. See reaper.Sweeper.
func (s *Sweeper) SweepBatch(ctx context.Context, limit int) (deleted int, more bool, err error) {
	if limit <= 0 {
		return 0, false, nil
	}
	us := s.grace.Microseconds()
	if s.dialect == sqllock.Postgres {
		var cand, n int64
		if err := s.db.QueryRowContext(ctx, sweepPostgres, us, limit).Scan(&cand, &n); err != nil {
			return 0, false, err
		}
		return int(n), cand >= int64(limit), nil
	}
	rows, err := s.db.QueryContext(ctx, sweepSelectMySQL, us, limit)
	if err != nil {
		return 0, false, err
	}
	type cand struct {
		key    []byte
		ticket int64
	}
	var cands []cand
	for rows.Next() {
		var c cand
		if err := rows.Scan(&c.key, &c.ticket); err != nil {
			rows.Close()
			return 0, false, err
		}
		cands = append(cands, c)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return 0, false, err
	}
	for _, c := range cands {
		if _, err := s.db.ExecContext(ctx, bumpMySQL, c.ticket, c.key); err != nil {
			return deleted, false, err
		}
		res, err := s.db.ExecContext(ctx, sweepDeleteMySQL, c.key, c.ticket, us)
		if err != nil {
			return deleted, false, err
		}
		n, _ := res.RowsAffected()
		deleted += int(n)
	}
	return deleted, len(cands) >= limit, nil
}
