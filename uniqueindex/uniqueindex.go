// Package uniqueindex is a lease lock held as a row under a unique key: acquiring
// inserts the row of the lock name into sqllock_lease (migration 0002), or takes over
// a free one; releasing deletes it (PostgreSQL) or frees it in place (MySQL).
//
// # Leases
//
// A row carries an owner, a fencing token, a hold count and an expiry computed on the
// database clock (clock_timestamp() on PostgreSQL, UTC_TIMESTAMP(6) on MySQL; the
// client clock is never compared with the server's). A row whose lease has expired is
// taken over atomically by the next attempt, so availability never waits for the
// reaper, and an expired row is never renewed: expiry is final.
//
// While a Lease is held, a keep-alive renews it every keep-alive interval (default
// TTL/3). If a renewal finds the row deleted, taken over or expired, or if no renewal
// succeeded for TTL less a safety margin (TTL/5), measured on the client from the
// start of the last successful renewal, the lease ends: Done closes and Err reports
// ErrLost. The server sets the expiry after it received the renewal, so a holder that
// is cut off, frozen or too slow gives the lease up before the database lets another
// client take it over. Err and Done look at the clock themselves: a holder resumed
// after a pause longer than its TTL learns of the loss at its first look. A renewal
// round trip must take less than 7/15 of the TTL (TTL - margin - interval) for a
// lease to survive one failed renewal; a grant that took long is renewed at once.
//
// # Fencing tokens
//
// So a token is strictly greater than every token granted before it for that name,
// also after the row was deleted, after a reaper sweep and after a database restart
// (committed rows survive it):
//
//   - PostgreSQL: one statement increments the per-name counter in sqllock_fence
//     (migration 0001; INSERT ... ON CONFLICT DO UPDATE, keeping the counter row
//     locked until commit, so attempts on a name are serialised) and inserts or takes
//     over the lease row with the new value. Release deletes the row; the counter
//     stays.
//   - MySQL: a lease row is kept while its name is in use: a release frees it in
//     place (no hold, no owner, expired), and its token is the last one granted, so
//     the statement that takes it over writes token + 1. A name without a row (first
//     use, or swept by the reaper, which first raises the name's sqllock_fence
//     counter to the row's token) continues from that counter, read with a locking
//     read in the same INSERT (the latest committed value, whatever the isolation
//     level). One statement, one commit (two when a take-over by UPDATE misses, see
//     Cost). Do not delete rows of sqllock_lease by hand
//     on MySQL: the token of the name would start again from sqllock_fence; use the
//     reaper or sqllock force-release.
//
// Failed attempts consume values on PostgreSQL: tokens increase but are not
// consecutive. Lease.Check verifies, inside the caller's own transaction, that a
// lease is still the current holder.
//
// # Owners and reentrancy
//
// Every acquisition has an owner of its own (the Locker's random identity and a
// nonce), so an attempt whose reply was lost is recognised as the caller's own when
// it is retried, and is deleted if the caller gives up. Host and pid are stored for
// operators. An acquisition with sqllock.WithOwner is reentrant within its Locker:
// the same owner key re-acquiring a lock it holds through the same Locker increments
// the hold count and gets the same token, and the lock is free when every acquisition
// was released.
//
// # Waiting
//
// Goroutines of one Locker that wait for the same name queue in FIFO order in the
// process and only the first one sends attempts, so inside a process the lock is
// handed on in order, with no herd.
//
// Across processes, an Acquire that finds the lock held waits in the server-side
// line of the name (see internal/wait.Line): a session lock per name
// (pg_advisory_lock; GET_LOCK on MySQL, namespaced by database) that the server
// grants in the order of the requests. The waiter's statement enters the line and,
// once its turn comes, makes its attempt; the holder that came through the line gives
// the line lock back in its release statement, once its row is locked. So contended
// acquisitions are granted in FIFO order across processes (a process that releases
// and asks again queues behind the others), each costs two statements (attempt,
// release) however many wait, and nobody polls. A Locker that saw contention on a
// name in the last two seconds enters the line at once. The line is a waiting aid:
// the lease row still decides who holds the lock. Its costs and limits:
//
//   - A waiter in line holds one pooled connection of its Locker, per name, from
//     its entry until it gives the lock back (at most 16 per Locker, and a quarter
//     of a bounded pool, none below 4 connections; beyond that, waiters wait without
//     the line). The lease's renewals run on that session. It carries a
//     server-enforced bound (idle_session_timeout and tcp_user_timeout on
//     PostgreSQL, wait_timeout on MySQL: the TTL), so a partitioned holder's line
//     lock is freed by the server, like its lease.
//   - A line lock held by a session that does not hold the lease (a frozen or
//     partitioned holder or waiter, before the bound ends its session) delays each
//     waiter by one entry's wait at most (the TTL, or the poll interval if longer):
//     the waiter then attempts directly and takes the lock once the lease row is
//     free, and does not use that name's line for 30 s. A lease held for longer than
//     that sends its waiters through one such direct attempt per entry's wait; they
//     enter the line again in the order their waits ran out.
//   - Behind a pooler (pgbouncer), on PostgreSQL, the server session is not the
//     one the client connected to (pg_backend_pid() differs from the pid pgx saw):
//     the first entry sees it, takes nothing and turns the Locker's line off (one
//     warning); its waiters wait as below. The same happens with a driver other
//     than pgx. On MySQL a release that finds its line lock gone turns the line off.
//   - On Galera, GET_LOCK is local to a node: processes on different nodes queue in
//     different lines and meet at the lease row.
//
// Without the line (TryAcquire never waits; a reentrant acquisition does not queue;
// a holder that did not come through the line), a waiter waits without holding a
// pooled connection: on PostgreSQL its failed attempt marks the lease row waited for,
// and the release of a marked row sends a NOTIFY in its DELETE statement (NOTIFY
// serialises the commits of the whole database, so a lock nobody waits for does not
// send one; migration 0006 adds the mark); one shared LISTEN connection per Locker
// (outside the pool, opened when a waiter first has to wait, closed by Close) wakes
// the first waiter of each Locker, and a fallback poll (at most the poll interval,
// or at the holder's expiry as computed by the database) covers lost notifications
// and dead holders. On MySQL such waiters back off exponentially with jitter, capped
// at the poll interval, and a release that finds someone in the line makes its
// Locker's next acquisition of the name queue there too.
//
// # Failover
//
// A lease is as durable as the database: on an asynchronously replicated primary, a
// failover to a replica that missed the last commits can forget a lease or repeat a
// token. Use synchronous replication where that matters.
//
// The Locker checks it before its first acquisition: on a PostgreSQL primary whose
// standbys replicate asynchronously, and on a MySQL source whose replicas do (no
// lossless semi-synchronous replication in force), it logs one warning, or refuses
// with sqllock.ErrUnsafeDeployment under WithRequireSyncReplication. With a synchronous
// standby a failover keeps leases and tokens (the ha suite kills the primary and
// promotes the standby). An attempt the caller gave up on whose commit the server
// finishes later (waiting for a synchronous standby that is away) deletes its row
// once the server answers: no lease of an exited caller stays live. On a Galera
// cluster, and in a MySQL Group Replication group (multi-primary too), the lease
// row is certified cluster-wide: safe from any node (a certification conflict,
// error 3101, is retried like a deadlock).
//
// # Cost
//
// Acquire+Release is two statements on both databases, contended or not (prepared
// once per Locker on MySQL, so each is one round trip with go-sql-driver's default
// settings; a turn in the line sends its two as text). On MySQL a turn's session
// also costs, when it is new to the Locker, the statements that set and later put
// back its bound and one that reads its id; the Locker keeps a few such sessions for
// reuse. On MySQL a Locker that was granted a name last time first tries a plain
// UPDATE of the freed row (takeFreeMySQL), cheaper for the server; if the name was
// taken meanwhile, or its row swept, that costs one statement more, and the Locker
// then forgets the name until it is granted it again. Reentrant acquisitions
// (sqllock.WithOwner) skip it. A renewal is one UPDATE per lease every keep-alive
// interval.
package uniqueindex

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/direct"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/internal/wait"
)

// Defaults of the options.
const (
	// DefaultTTL is the lease time: a holder that stops renewing loses the lock after it.
	DefaultTTL = rowlease.DefaultTTL
	// DefaultPollInterval caps the time a waiter sleeps between attempts.
	DefaultPollInterval = rowlease.DefaultPollInterval
	// DefaultAttemptTimeout bounds one attempt or one renewal statement.
	DefaultAttemptTimeout = rowlease.DefaultAttemptTimeout
)

// Option configures a Locker. Options are validated by New.
type Option func(*rowlease.Config) error

// WithTTL sets the lease time of the Locker's leases (DefaultTTL): the
// server-enforced bound, on the database clock, after which a holder that stopped
// renewing loses the lock. sqllock.WithLeaseTTL overrides it for one acquisition.
func WithTTL(d time.Duration) Option { return func(c *rowlease.Config) error { return c.SetTTL(d) } }

// WithKeepalive sets how often a lease is renewed (default TTL/3). It must be
// positive and at most half the TTL.
func WithKeepalive(d time.Duration) Option {
	return func(c *rowlease.Config) error { return c.SetInterval(d) }
}

// WithPollInterval caps the sleep of a waiter between two attempts
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

// Locker acquires uniqueindex leases. It is safe for concurrent use. Close it when
// done: it stops the PostgreSQL listener. Leases stay valid after Close until they are
// released.
type Locker struct {
	b *rowlease.Locker
	// granted remembers, per slot of keys, the last key this Locker was granted on
	// MySQL, until an attempt on it finds it held (see takeFreeMySQL).
	granted [256]atomic.Uint64

	onTransient func(op string, err error) // test hook: a transient error is retried
	onTakeFree  func(granted bool)         // test hook: takeFreeMySQL ran
}

// retryTransient is wait.Retry with the Locker's transient-error hook.
func (l *Locker) retryTransient(ctx context.Context, op string, f func() error) error {
	return wait.Retry(ctx, f, func(err error) { l.transient(op, err) })
}

// transient notes a transient error about to be retried.
func (l *Locker) transient(op string, err error) {
	l.b.Cfg.Logger.Debug("sqllock/uniqueindex: transient error, retrying", "op", op, "err", err)
	if l.onTransient != nil {
		l.onTransient(op, err)
	}
}

// New returns a Locker on db, which must have been migrated (migrations.Up). It sends
// no SQL. It returns an error matching sqllock.ErrInvalidOption for an invalid
// dialect or option.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := rowlease.Defaults()
	if err := lease.New("uniqueindex", db, d, &cfg, &cfg.Config, opts); err != nil {
		return nil, err
	}
	b := rowlease.New("uniqueindex", db, d, cfg, channel)
	b.EnableLine()
	return &Locker{b: b}, nil
}

// Close stops the shared PostgreSQL listener and wakes the waiters, which go on by
// polling. Held leases are not released. Close is idempotent.
func (l *Locker) Close() error {
	l.b.Close()
	return nil
}

// Holder returns the current holder of name: the host, pid, token and grant time
// its lease row records, and the time left of its lease, both on the database clock.
// It sends one read statement and takes no lock. It returns an error matching
// sqllock.ErrNoHolder when no live lease row exists (a row whose expiry has passed
// is not a holder). See sqllock.HolderInspector and sqllock.Leader.
func (l *Locker) Holder(ctx context.Context, name string) (sqllock.Holder, error) {
	return l.b.Holder(ctx, name, l.b.Pick(holderPostgres, holderMySQL))
}

// sawContention records that a release found someone waiting for key: the Locker's
// next acquisition of it waits in the server-side line at once instead of taking the
// lock from under the waiters.
func (l *Locker) sawContention(key []byte) {
	if l.b.Line != nil {
		l.b.Line.Saw(string(key))
	}
}

// exec runs query through the Locker's statement cache (prepared once per Locker on
// MySQL).
func (l *Locker) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return l.b.Stmts.Exec(ctx, query, args...)
}

// Acquire waits until the lock name is held, or ctx ends. See sqllock.Locker.
// sqllock.WithOwner makes the acquisition reentrant within this Locker;
// sqllock.WithLeaseTTL overrides the lease time (its keep-alive interval is then a
// third of it).
func (l *Locker) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	le, err := l.acquire(ctx, "acquire", name, opts, true)
	if err != nil {
		return nil, err
	}
	return le, nil
}

// TryAcquire makes one attempt (transient conflicts are retried a few times) and
// returns an error matching sqllock.ErrNotAcquired if the lock is held.
func (l *Locker) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	le, err := l.acquire(ctx, "try-acquire", name, opts, false)
	if err != nil {
		return nil, err
	}
	return le, nil
}

type attemptResult struct {
	ok        bool
	entered   bool // the statement entered the server-side line
	waited    bool // and waited there
	token     int64
	remaining time.Duration // holder's remaining lease, 0 if unknown
	start     time.Time     // when the statement that set the expiry was sent
}

func (l *Locker) acquire(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	return lease.Observed(ctx, l.b.Cfg.Label("uniqueindex", l.b.Dialect, name), block, func(ctx context.Context) (*Lease, error) {
		return l.acquireLease(ctx, op, name, opts, block)
	}, (*Lease).observed)
}

func (l *Locker) acquireLease(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	ac, tm, err := l.b.Prelude(ctx, op, name, opts)
	if err != nil {
		return nil, err
	}
	reentrant := ac.Owner != ""
	owner := l.b.Owner('L', ac.Owner)
	key := namekey.Key(name)
	var res attemptResult
	slot, turn, uncertain, kind, err := wait.Loop{
		Hub: l.b.Hub, Key: string(key), Block: block, Queue: !reentrant, Poll: l.b.Cfg.Poll, Log: l.b.Cfg.Logger,
		OnTransient: func(err error) { l.transient(op, err) },
		Attempt: func(ctx context.Context) (wait.Result, error) {
			var err error
			res, err = l.attempt(ctx, nil, false, key, name, owner, tm.TTL, reentrant, block)
			return l.fresh(ctx, nil, &res, key, owner, tm.TTL, err)
		},
		Line: l.b.Line,
		InLine: func(ctx context.Context, t *wait.Turn, enter bool) (wait.Result, error) {
			var err error
			res, err = l.attempt(ctx, t, enter, key, name, owner, tm.TTL, reentrant, block)
			return l.fresh(ctx, t, &res, key, owner, tm.TTL, err)
		},
	}.Run(ctx)
	if err != nil {
		if uncertain && !reentrant {
			l.forget(ctx, key, owner)
		}
		return nil, l.b.Errorf(op, name, kind, err)
	}
	le := l.newLease(name, key, owner, res.token, tm, reentrant, res.start, slot, turn)
	if err := lease.Granted(ctx, le.core.Label(), op, le.Release); err != nil {
		return nil, err
	}
	return le, nil
}

// fresh turns an attempt's outcome into the loop's, renewing a grant at once if its
// statement took long (rowlease.Fresh): on turn t's session, if the grant came
// through the line (rowlease.Kept).
func (l *Locker) fresh(ctx context.Context, t *wait.Turn, res *attemptResult, key, owner []byte, ttl time.Duration, err error) (wait.Result, error) {
	if err == nil && res.ok {
		res.start, res.ok, err = l.b.Fresh(ctx, res.start, ttl, func(ctx context.Context) (bool, error) {
			n, err := l.b.Kept(ctx, t, nil, l.b.Pick(renewPostgres, renewMySQL), renewArgs(l.b.Dialect, key, owner, res.token, ttl)...)
			return n > 0, err
		})
	}
	return wait.Result{Acquired: err == nil && res.ok, HolderLeft: res.remaining, Entered: res.entered, Waited: res.waited}, err
}

// attempt makes one attempt: on the pool (t nil), or on turn t's session, entering
// the server-side line first if enter is set.
func (l *Locker) attempt(ctx context.Context, t *wait.Turn, enter bool, key []byte, name string, owner []byte, ttl time.Duration, reentrant, block bool) (attemptResult, error) {
	actx, cancel := l.b.AttemptContext(ctx)
	defer cancel()
	var lineWait time.Duration
	if enter {
		// The entry waits in the server for its turn, up to the line's wait, and the
		// attempt after it is bounded as usual.
		actx, cancel, lineWait = l.b.Line.EntryContext(ctx, l.b.Cfg.Attempt)
		defer cancel()
	}
	us := ttl.Microseconds()
	if l.b.Dialect == sqllock.Postgres {
		var tok, holds, rem int64
		var waited sql.NullBool
		var res attemptResult
		query, args := acquirePostgres, []any{key, []byte(name), owner, us, reentrant, l.b.Host, l.b.PID, block}
		dest := []any{&tok, &holds, &rem}
		if enter {
			query = acquireLinePostgres
			args = append(args, pin.Millis(lineWait), pin.Millis(ttl), nil)
			dest = append(dest, &waited)
		}
		stmt := func(qctx context.Context, conn *sql.Conn) error {
			if enter {
				args[len(args)-1] = wait.PgPID(conn)
			}
			// The grant's clock starts when the statement is sent, not before the
			// connection was obtained (possibly dialled).
			res.start = l.b.Now()
			return direct.Row(qctx, conn, query, args, dest...)
		}
		var err error
		if t != nil {
			err = t.Run(actx, "uniqueindex attempt", stmt)
		} else {
			err = l.b.OnConn(actx, "uniqueindex attempt", stmt)
		}
		switch {
		case enter && sqlerr.Is(err, sqlerr.LockTimeout):
			return attemptResult{}, nil // the line's wait ran out: not entered
		case enter && err == nil && !waited.Valid:
			l.b.Line.Off("the server session is not the one the client connected to")
			return attemptResult{}, nil
		case errors.Is(err, sql.ErrNoRows):
			return attemptResult{entered: enter}, nil
		case err != nil:
			return attemptResult{}, err
		}
		res.ok, res.token, res.remaining = tok > 0, tok, time.Duration(rem)*time.Microsecond
		res.entered, res.waited = enter, waited.Bool
		return res, nil
	}
	start := l.b.Now()
	var r sql.Result
	var err error
	if t == nil {
		if !reentrant && l.lastGranted(key) {
			// Most likely the row is there and free: take it over by its primary key.
			if res, ok, err := l.takeFree(actx, key, owner, us, start); ok || err != nil {
				return res, err
			}
			// Held, or no row: the full attempt tells which (or inserts).
			start = l.b.Now()
		}
		r, err = l.exec(actx, acquireMySQL, key, []byte(name), owner, key, us, l.b.Host, l.b.PID,
			owner, l.b.Host, l.b.PID, owner, reentrant, owner, owner, us)
	} else {
		q := l.acquireText(enter, key, name, owner, us, reentrant, lineWait)
		err = t.Run(actx, "uniqueindex attempt", func(qctx context.Context, conn *sql.Conn) error {
			start = l.b.Now()
			r, err = conn.ExecContext(qctx, q)
			return err
		})
	}
	if err != nil {
		return attemptResult{}, err
	}
	id, err := r.LastInsertId()
	if err != nil {
		return attemptResult{}, err
	}
	if id == 0 { // nothing ran: the line's wait ran out
		return attemptResult{}, nil
	}
	// See acquireMySQL: odd is a grant of token id/2, even a lock held by another.
	l.noteOutcome(key, id%2 == 1)
	return attemptResult{ok: id%2 == 1, token: id / 2, start: start, entered: enter}, nil
}

// takeFree sends takeFreeMySQL (start: when it is sent). ok reports a grant; a row
// it did not change (held, or gone) is neither a grant nor an error.
func (l *Locker) takeFree(ctx context.Context, key, owner []byte, us int64, start time.Time) (res attemptResult, ok bool, err error) {
	r, err := l.exec(ctx, takeFreeMySQL, l.b.Host, l.b.PID, owner, us, key)
	if err != nil {
		return attemptResult{}, false, err
	}
	n, err := r.RowsAffected()
	if err != nil {
		return attemptResult{}, false, err
	}
	if l.onTakeFree != nil {
		l.onTakeFree(n == 1)
	}
	if n != 1 {
		return attemptResult{}, false, nil
	}
	tok, err := r.LastInsertId()
	if err == nil && tok <= 0 {
		err = fmt.Errorf("uniqueindex: a take-over returned token %d", tok)
	}
	if err != nil {
		return attemptResult{}, false, err
	}
	return attemptResult{ok: true, token: tok, start: start}, true, nil
}

// noteOutcome records whether the last full attempt on key (MySQL) was granted.
func (l *Locker) noteOutcome(key []byte, granted bool) {
	slot, h := grantedSlot(key)
	if granted {
		l.granted[slot].Store(h)
	} else {
		l.granted[slot].CompareAndSwap(h, 0)
	}
}

// lastGranted reports whether this Locker's last full attempt on key was granted:
// the row then exists (MySQL frees rows in place), and is likely free again. A
// heuristic: a wrong guess costs one statement, never correctness.
func (l *Locker) lastGranted(key []byte) bool {
	slot, h := grantedSlot(key)
	return l.granted[slot].Load() == h
}

// grantedSlot is key's slot in Locker.granted and the value recorded there (never
// 0): the key's first 8 bytes. Keys are SHA-256 digests (namekey.Key).
func grantedSlot(key []byte) (int, uint64) {
	h := binary.BigEndian.Uint64(key)
	return int(h & 0xff), h | 1<<63
}

// acquireText is acquireMySQL as text for a turn's session, with its values in it
// (hexadecimal literals and numbers: nothing to quote), entering the line first if
// enter is set.
func (l *Locker) acquireText(enter bool, key []byte, name string, owner []byte, us int64, reentrant bool, lineWait time.Duration) string {
	k, o, h := namekey.MySQLHex(key), namekey.MySQLHex(owner), namekey.MySQLHex([]byte(l.b.Host))
	from := ""
	if enter {
		from = "\nFROM " + wait.MyEnter(l.b.Line.MyName(k), lineWait) + " q"
	}
	u, pid, re := strconv.FormatInt(us, 10), strconv.FormatInt(l.b.PID, 10), "FALSE"
	if reentrant {
		re = "TRUE"
	}
	vals := []string{k, namekey.MySQLHex([]byte(name)), o, k, u, h, pid, o, h, pid, o, re, o, o, u}
	var b strings.Builder
	for i, part := range acquireTextParts[b2i(enter)] {
		if i == acquireTextFrom {
			b.WriteString(from)
		}
		b.WriteString(part)
		if i < len(vals) {
			b.WriteString(vals[i])
		}
	}
	return b.String()
}

// acquireTextParts is acquireMySQLFmt without and with the line's correlation, split
// at its parameters, once: acquireText puts the values between the parts, and the
// line's entry (%[1]s) before part acquireTextFrom.
var acquireTextParts = [2][]string{
	strings.Split(fmt.Sprintf(acquireMySQLFmt, "", freeMySQL, ""), "?"),
	strings.Split(fmt.Sprintf(acquireMySQLFmt, "", freeMySQL, " AND q.waited IS NOT NULL"), "?"),
}

// acquireTextFrom is the part of acquireTextParts that follows the pid parameter,
// after which acquireMySQLFmt has the entry (%[1]s).
const acquireTextFrom = 7

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// forget deletes the row an attempt of owner may have committed without the caller
// learning of it (see wait.Forget), waiting at most the attempt timeout (and
// GiveBackTimeout). On MySQL a statement abandoned while it waited in the server may
// still commit after this; such a row, renewed by nobody, expires after its TTL.
func (l *Locker) forget(ctx context.Context, key, owner []byte) {
	var probe func(context.Context) (bool, error)
	q := forgetMySQL
	if l.b.Dialect == sqllock.Postgres {
		q = forgetPostgres
	} else {
		probe = func(ctx context.Context) (bool, error) {
			var one int
			err := l.b.DB.QueryRowContext(ctx, forgetProbeMySQL, key, owner).Scan(&one)
			if errors.Is(err, sql.ErrNoRows) {
				return false, nil
			}
			return err == nil, err
		}
	}
	wait.Forget(ctx, min(lease.GiveBackTimeout, l.b.Cfg.Attempt), probe, func(ctx context.Context) error {
		_, err := l.exec(ctx, q, key, owner)
		return err
	}, l.b.Cfg.Logger)
}

// Sweeper deletes expired lease rows for the reaper package (it implements
// reaper.Sweeper).
type Sweeper struct {
	db      *sql.DB
	dialect sqllock.Dialect
	grace   time.Duration
}

// NewSweeper returns the Sweeper of the lease table: each batch deletes rows whose
// lease expired (or, on MySQL, was released) more than grace ago by the database
// clock, in short statements that lock only the rows they delete (see SweepBatch).
// Tokens are unaffected: on PostgreSQL they live in sqllock_fence, which is never
// swept; on MySQL, where a row carries its name's last token, the batch first raises
// the name's sqllock_fence counter to it.
func NewSweeper(db *sql.DB, d sqllock.Dialect, grace time.Duration) (*Sweeper, error) {
	if db == nil || !d.Valid() || grace < 0 {
		return nil, &sqllock.Error{Op: "new-sweeper", Dialect: d, Kind: sqllock.ErrInvalidOption,
			Err: fmt.Errorf("need a *sql.DB, a valid dialect and a grace period >= 0 (got %v)", grace)}
	}
	return &Sweeper{db: db, dialect: d, grace: grace}, nil
}

// Name returns "sqllock_lease".
func (s *Sweeper) Name() string { return "sqllock_lease" }

// SweepBatch deletes at most limit expired rows, oldest first, and returns how many
// it deleted and whether the batch was full (limit candidates were found, so more may
// be left).
//
// On PostgreSQL it is one statement that locks its candidates FOR UPDATE SKIP LOCKED
// and deletes them: it never waits for a lock. On MySQL it reads the keys of the
// candidates without locking, then, in one transaction, raises their names' counters
// and deletes them by primary key, re-checking their expiry, locking only those rows
// and no index range, so that live leases (their Release, renewal or takeover) are
// never blocked by a sweep (rowlease.StashingSweepMySQL). A deadlock or lock wait
// timeout is returned as is; the reaper retries the batch.
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
	return rowlease.StashingSweepMySQL(ctx, s.db, "sqllock_lease", "token", true, us, limit)
}
