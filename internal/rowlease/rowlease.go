// Package rowlease is what the strategies that hold a lease row (uniqueindex,
// optimistic, fairqueue) share besides the lease core: their options, the identity
// and owners of a Locker, the bounds of a statement, and the renewal and release
// statements' bookkeeping.
package rowlease

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/deploy"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/prep"
	"github.com/sqllock/sqllock/internal/wait"
)

// Defaults of the row strategies' options.
const (
	DefaultTTL            = 30 * time.Second
	DefaultPollInterval   = 2 * time.Second
	DefaultAttemptTimeout = 10 * time.Second
)

// AsyncRelease is a condition for the WHERE clause of a PostgreSQL release
// statement: it makes the statement's own transaction commit without waiting for
// its WAL to reach disk (synchronous_commit off, for this transaction only), which
// saves a disk flush (about 150 µs here) on every release. It is safe for a release,
// and only for a release: the row is free for everyone as soon as the statement
// returns; a crash of the server before the WAL writer flushes it (within
// 3 x wal_writer_delay) can only bring the row back as it was before the release,
// held by a holder that is gone, until it expires (a TTL). Any acquisition that saw
// the release commits synchronously, and WAL is flushed in order, so a durable
// acquisition implies a durable release before it: the lock is never granted twice.
// The forget of an attempt of unknown outcome uses it too, for the same reason, and
// so that it never waits for a synchronous standby that is away.
const AsyncRelease = "set_config('synchronous_commit', 'off', true) IS NOT NULL"

// Config is the configuration of a row strategy's Locker.
type Config struct {
	lease.Config
	Poll    time.Duration // longest sleep of a waiter between two attempts
	Attempt time.Duration // bound of one statement
}

// Defaults returns the default configuration.
func Defaults() Config {
	return Config{Config: lease.Config{Timing: lease.Timing{TTL: DefaultTTL}}, Poll: DefaultPollInterval, Attempt: DefaultAttemptTimeout}
}

// SetPoll sets the longest sleep of a waiter between two attempts.
func (c *Config) SetPoll(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("poll interval %v is not positive", d)
	}
	c.Poll = d
	return nil
}

// SetAttempt sets the bound of one statement.
func (c *Config) SetAttempt(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("attempt timeout %v is not positive", d)
	}
	c.Attempt = d
	return nil
}

// Locker is the shared part of a row strategy's Locker. Safe for concurrent use.
type Locker struct {
	DB       *sql.DB
	Dialect  sqllock.Dialect
	Cfg      Config
	Strategy string
	Host     string
	PID      int64
	Now      func() time.Time // injectable for tests
	Hub      *wait.Hub
	Stmts    *prep.Cache
	Guard    *deploy.Guard
	// Line is the server-side waiting line of the strategies that use one (see
	// wait.Line; EnableLine), or nil.
	Line *wait.Line

	id    []byte
	nonce atomic.Uint64

	holdsMu sync.Mutex
	holds   map[string]*sharedHolds // reentrant holds by key and owner (StartLease)
}

// sharedHolds is the lease.Holds of the live reentrant leases of one key and owner.
type sharedHolds struct {
	holds lease.Holds
	refs  int
}

// New returns the shared part of a Locker of strategy on db, whose configuration was
// validated (lease.New). Waiters are woken by NOTIFYs on channel (PostgreSQL).
func New(strategy string, db *sql.DB, d sqllock.Dialect, cfg Config, channel string) *Locker {
	id := make([]byte, 16)
	rand.Read(id)
	host, _ := os.Hostname()
	if len(host) > 255 {
		host = host[:255]
	}
	return &Locker{
		DB: db, Dialect: d, Cfg: cfg, Strategy: strategy, Host: host, PID: int64(os.Getpid()), Now: time.Now,
		Hub: wait.NewHub(db, d, strategy, channel, cfg.Logger), Stmts: prep.New(db, d), id: id,
		Guard: cfg.Guard(db, d, strategy, deploy.Needs{}),
	}
}

// EnableLine gives the Locker a server-side waiting line (wait.Line): its contended
// acquisitions then wait in the database's own lock queue, in FIFO order across
// processes.
func (b *Locker) EnableLine() {
	b.Line = wait.NewLine(b.DB, b.Dialect, b.Strategy, b.Cfg.Timing.TTL, b.Cfg.Poll, b.Cfg.Logger)
}

// Close stops the PostgreSQL listener (waiters go on by polling), closes the
// prepared statements and returns the line's kept sessions. Idempotent.
func (b *Locker) Close() {
	b.Hub.Close()
	b.Stmts.Close()
	if b.Line != nil {
		b.Line.Close()
	}
}

// Owner returns the owner of one acquisition: tag, the Locker's identity and a fresh
// nonce; or, with an owner key (reentrancy), 'K', the identity and a hash of the key
// (a key may be as long as a name, more than an owner column holds).
func (b *Locker) Owner(tag byte, key string) []byte {
	if key != "" {
		h := sha256.Sum256([]byte(key))
		return append(append([]byte{'K'}, b.id...), h[:16]...)
	}
	o := make([]byte, 1+len(b.id)+8)
	o[0] = tag
	copy(o[1:], b.id)
	binary.BigEndian.PutUint64(o[1+len(b.id):], b.nonce.Add(1))
	return o
}

// Timing returns the timing of one acquisition: the Locker's, or a lease time given
// with sqllock.WithLeaseTTL.
func (b *Locker) Timing(ac sqllock.AcquireConfig) (lease.Timing, error) {
	if ac.TTL == 0 {
		return b.Cfg.Timing, nil
	}
	return lease.Timing{TTL: ac.TTL}.Resolve()
}

// AttemptContext bounds one statement: the attempt timeout, and never more than what
// is left of ctx. It runs detached from ctx's cancellation, so that a grant is never
// lost in flight (the caller gives it back if ctx ended meanwhile).
func (b *Locker) AttemptContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d := b.Cfg.Attempt
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, max(time.Until(dl), time.Millisecond))
	}
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}

// Errorf returns the strategy's error for op on name (see lease.NewError).
func (b *Locker) Errorf(op, name string, kind, err error) error {
	return lease.NewError(op, b.Dialect, name, kind, err)
}

// Pick returns pg on PostgreSQL and my on MySQL.
func (b *Locker) Pick(pg, my string) string {
	if b.Dialect == sqllock.Postgres {
		return pg
	}
	return my
}

// Changed runs a statement that changes at most one row of the lease, retrying
// transient errors (onRetry, if set, is told of each), and returns the rows changed:
// the affected rows, or, for a statement that returns rows (a PostgreSQL WITH ...
// SELECT that also notifies waiters), how many it returned. It runs as an Exec: unlike
// a query with a context, that starts no goroutine of database/sql's.
func (b *Locker) Changed(ctx context.Context, onRetry func(error), query string, args ...any) (int64, error) {
	var n int64
	err := wait.Retry(ctx, func() error {
		res, err := b.Stmts.Exec(ctx, query, args...)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	}, onRetry)
	return n, err
}

// Kept runs a lease's renewal statement (see Changed): on the session of turn t, if
// any, which keeps it from idling into its server-enforced bound (the server would
// end it and free the line lock while the lease lives) and needs no second pooled
// connection; else, or if that session fails, on the pool.
func (b *Locker) Kept(ctx context.Context, t *wait.Turn, onRetry func(error), query string, args ...any) (int64, error) {
	if t != nil && !t.Dirty() {
		var n int64
		err := t.Run(ctx, b.Strategy+" keepalive", func(qctx context.Context, conn *sql.Conn) error {
			res, err := conn.ExecContext(qctx, query, args...)
			if err != nil {
				return err
			}
			n, err = res.RowsAffected()
			return err
		})
		if err == nil || !t.Dirty() {
			return n, err
		}
	}
	return b.Changed(ctx, onRetry, query, args...)
}

// Renewed turns what a renewal statement changed into the keep-alive's answer: a
// lease row that no longer matches (deleted, taken over, expired) is gone.
func Renewed(n int64, err error) (time.Duration, error) {
	if err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, lease.Gonef("the lease's row was deleted, taken over or has expired")
	}
	return 0, nil
}

// Released turns what a release statement changed into the give-back's answer.
func Released(n int64, err error, lost bool, what string) error {
	switch {
	case lost:
		return nil // freed what was still the lease's, if anything
	case err != nil:
		return err
	case n == 0:
		return lease.Gonef("%s deleted or taken over before release", what)
	}
	return nil
}

// Check runs the fencing check query (a locking read of the lease's row, as the last
// statement of tx) after checking the lease core: see the strategies' Check.
func Check(ctx context.Context, core *lease.Lease, tx *sql.Tx, query string, args ...any) error {
	if err := core.Err(); err != nil {
		return err
	}
	var one int
	err := tx.QueryRowContext(ctx, query, args...).Scan(&one)
	if err == sql.ErrNoRows {
		return core.Label().Err("check", sqllock.ErrLost, fmt.Errorf("the lease is no longer the current holder"))
	}
	if err != nil {
		return core.Label().Err("check", nil, err)
	}
	return nil
}

// OnConn runs a PostgreSQL statement on a connection of its own whose wait the
// server abandons when ctx ends (a cancel request, see internal/interrupt), so that
// no backend goes on waiting, and maybe commits, after the caller gave up: a commit
// waiting for a synchronous standby is cancelled too, which makes it visible on the
// primary at once, where the caller's forget finds and deletes it.
func (b *Locker) OnConn(ctx context.Context, label string, stmt func(qctx context.Context, conn *sql.Conn) error) error {
	conn, err := b.DB.Conn(ctx)
	if err != nil {
		return err
	}
	dirty, err := interrupt.Interrupter{DB: b.DB, Logger: b.Cfg.Logger}.Run(ctx,
		interrupt.Target{PgConn: interrupt.PgConn(conn), Label: label}, false,
		func(qctx context.Context) error { return stmt(qctx, conn) })
	interrupt.Release(conn, dirty)
	return err
}

// Prelude checks an acquisition before its own SQL is sent: the name, the options
// (and the lease time they give), and lease.Admit. Its error is the one Acquire
// returns.
func (b *Locker) Prelude(ctx context.Context, op, name string, opts []sqllock.AcquireOption) (sqllock.AcquireConfig, lease.Timing, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return sqllock.AcquireConfig{}, lease.Timing{}, err
	}
	ac, err := sqllock.ApplyAcquireOptions(op, b.Dialect, name, opts)
	if err != nil {
		return ac, lease.Timing{}, err
	}
	tm, err := b.Timing(ac)
	if err != nil {
		return ac, tm, b.Errorf(op, name, sqllock.ErrInvalidOption, err)
	}
	return ac, tm, lease.Admit(ctx, b.Guard, op, b.Dialect, name)
}

// StartLease starts the lease core of a lock granted to a waiter of key that held
// slot (nil if none), with keeper k: when the lease ends, the slot goes to the next
// waiter of this Locker, who is woken at once. reentrant is the owner of a reentrant
// acquisition (sqllock.WithOwner), nil otherwise: the live leases of one key and
// owner count as one holder in telemetry.
func (b *Locker) StartLease(k lease.Keeper, tm lease.Timing, name string, key, reentrant []byte, granted time.Time, slot *wait.Slot) *lease.Lease {
	skey := string(key)
	var holds *lease.Holds
	release := func() {}
	if reentrant != nil {
		hkey := skey + "\x00" + string(reentrant)
		b.holdsMu.Lock()
		if b.holds == nil {
			b.holds = map[string]*sharedHolds{}
		}
		sh := b.holds[hkey]
		if sh == nil {
			sh = &sharedHolds{}
			b.holds[hkey] = sh
		}
		sh.refs++
		b.holdsMu.Unlock()
		holds = &sh.holds
		release = func() {
			b.holdsMu.Lock()
			if sh.refs--; sh.refs == 0 && b.holds[hkey] == sh {
				delete(b.holds, hkey)
			}
			b.holdsMu.Unlock()
		}
	}
	return lease.Prepare(k, lease.Params{
		Timing:  tm,
		Granted: granted,
		Label:   b.Cfg.Label(b.Strategy, b.Dialect, name),
		Log:     b.Cfg.Logger,
		Now:     b.Now,
		Holds:   holds,
		OnEnd: func() {
			release()
			if slot != nil {
				slot.Leave() // hands the slot on and wakes the next waiter
				return
			}
			b.Hub.Wake(skey)
		},
	})
}

// Fresh makes sure a grant whose statement was sent at start is not handed out
// nearly expired: a statement that waited long in the server (for a row lock held by
// a Check transaction, say) leaves little of the lease on the client's clock, so such
// a grant is renewed at once, with renew (the strategy's renewal statement, which
// reports whether the lease was still live). It returns when the lease's clock now
// starts, and whether the grant stands; a grant that is already dead is not one.
func (b *Locker) Fresh(ctx context.Context, start time.Time, ttl time.Duration, renew func(context.Context) (bool, error)) (time.Time, bool, error) {
	if b.Now().Sub(start) < ttl/3 {
		return start, true, nil
	}
	actx, cancel := b.AttemptContext(ctx)
	defer cancel()
	again := b.Now()
	ok, err := renew(actx)
	if err != nil || !ok {
		return start, false, err
	}
	return again, true, nil
}

// Holder reads the holder of name with query (the strategy's, chosen by Pick), which
// takes the lock key and returns one row, or none when the lock is free: host, pid,
// token, the grant's time in µs since the Unix epoch and the lease's remaining time
// in µs, both on the database clock. See sqllock.HolderInspector.
func (b *Locker) Holder(ctx context.Context, name, query string) (sqllock.Holder, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return sqllock.Holder{}, err
	}
	h := sqllock.Holder{Name: name}
	var since, left int64
	err := b.DB.QueryRowContext(ctx, query, namekey.Key(name)).Scan(&h.Host, &h.PID, &h.Token, &since, &left)
	if errors.Is(err, sql.ErrNoRows) {
		return sqllock.Holder{}, b.Errorf("holder", name, sqllock.ErrNoHolder, nil)
	}
	if err != nil {
		return sqllock.Holder{}, b.Errorf("holder", name, nil, err)
	}
	h.Since = time.UnixMicro(since).UTC()
	h.Remaining = time.Duration(left) * time.Microsecond
	return h, nil
}
