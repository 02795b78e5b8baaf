// Package uniqueindex is a lease lock held as a row under a unique key: acquiring
// inserts the row of the lock name into sqllock_lease (migration 0002), releasing
// deletes it.
//
// # Leases
//
// A row carries an owner, a fencing token, a hold count and an expiry computed on the
// database clock (clock_timestamp() on PostgreSQL, UTC_TIMESTAMP(6) on MySQL; the
// client clock is never compared with the server's). A row whose lease has expired is
// taken over atomically by the next attempt, so availability never waits for the
// reaper. While a Lease is held, a watchdog goroutine renews it every RenewInterval
// (default TTL/3). If a renewal finds the row deleted or taken over, or if no renewal
// succeeded for TTL minus a safety margin (TTL/5) measured on the client's monotonic
// clock from the start of the last successful renewal, the lease closes Done and Err
// reports ErrLost. The server sets the expiry after it received the renewal, so the
// client gives the lease up before the database lets another client take it over.
// Transient renewal errors (a failover, a restart, a cut connection) are retried until
// that deadline.
//
// # Fencing tokens
//
// Tokens come from the per-name counter in sqllock_fence (migration 0001), which
// neither Release nor the reaper ever deletes and which is committed with the grant:
//
//   - PostgreSQL: one statement increments the counter (INSERT ... ON CONFLICT DO
//     UPDATE, keeping the counter row locked until commit, so attempts on a name are
//     serialised) and inserts or takes over the lease row with the new value.
//   - MySQL: fence.Next increments the counter, then the lease row is written by an
//     INSERT ... SELECT that reads the counter with a locking read (the latest
//     committed value, whatever the isolation level) and inserts nothing if another
//     attempt incremented it in between; that attempt is simply retried.
//
// So a token is strictly greater than every token granted before it for that name,
// also after the row was deleted, after a reaper sweep and after a database restart
// (committed rows survive it). Failed attempts consume values: tokens increase but
// are not consecutive. Lease.Check verifies, inside the caller's own transaction, that
// a lease is still the current holder.
//
// # Owners and reentrancy
//
// Each Locker has a random owner identity; host and pid are stored for operators. An
// acquisition with sqllock.WithOwner is reentrant: the same owner key re-acquiring a
// lock it holds increments the hold count and gets the same token, and the lock is
// free when every acquisition was released.
//
// # Waiting
//
// Acquire waits without holding a pooled connection. Goroutines of one Locker that
// wait for the same name queue in FIFO order in the process and only the first one
// sends attempts, so inside a process the lock is handed on in order with one
// statement (two on MySQL) and no herd. On PostgreSQL a release sends a NOTIFY in its
// DELETE statement; one shared LISTEN connection per Locker (outside the pool, opened
// when a waiter first has to wait, closed by Close) wakes the first waiter of each
// Locker, and a fallback poll (at most PollInterval, or at the holder's expiry as
// computed by the database) covers lost notifications and dead holders. On MySQL
// waiters back off exponentially with jitter, capped at PollInterval.
//
// # Cost
//
// Uncontended, Acquire+Release is two statements on PostgreSQL and three on MySQL
// (fence increment, insert, delete; prepared once per Locker, so each is one round
// trip with go-sql-driver's default settings). A renewal is one UPDATE per lease
// every RenewInterval.
package uniqueindex

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Defaults of the options.
const (
	// DefaultTTL is the lease time: a holder that stops renewing loses the lock after it.
	DefaultTTL = 30 * time.Second
	// DefaultPollInterval caps the time a waiter sleeps between attempts.
	DefaultPollInterval = 2 * time.Second
	// DefaultAttemptTimeout bounds one attempt or one renewal statement.
	DefaultAttemptTimeout = 10 * time.Second
)

// maxTransient is how many times a statement that meets a transient error (deadlock,
// serialization failure, lock wait timeout, duplicate key) is sent in a row: by
// TryAcquire before it reports ErrNotAcquired, by Release and Refresh before they
// report the error (wrapped in a *sqllock.Error).
const maxTransient = 5

// transientPolicy spaces those retries: short, jittered, so that the two sides of a
// deadlock do not meet again in step.
var transientPolicy = backoff.Policy{Min: 2 * time.Millisecond, Max: 64 * time.Millisecond}

// Option configures a Locker.
type Option func(*config)

type config struct {
	ttl, renew, poll, attempt time.Duration
	logger                    *slog.Logger
}

// WithTTL sets the default lease time (DefaultTTL). It must be at least twice the
// renewal interval.
func WithTTL(d time.Duration) Option { return func(c *config) { c.ttl = d } }

// WithRenewInterval sets how often the watchdog renews a lease (default TTL/3). It
// must be positive and at most half the TTL.
func WithRenewInterval(d time.Duration) Option { return func(c *config) { c.renew = d } }

// WithPollInterval caps the sleep of a waiter between two attempts
// (DefaultPollInterval).
func WithPollInterval(d time.Duration) Option { return func(c *config) { c.poll = d } }

// WithAttemptTimeout bounds each statement the Locker sends
// (DefaultAttemptTimeout).
func WithAttemptTimeout(d time.Duration) Option { return func(c *config) { c.attempt = d } }

// WithLogger sets the logger of lease losses and listener errors (default
// slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// Locker acquires uniqueindex leases. It is safe for concurrent use. Close it when
// done: it stops the PostgreSQL listener. Leases stay valid after Close until they are
// released.
type Locker struct {
	db      *sql.DB
	dialect sqllock.Dialect
	cfg     config
	owner   []byte // default owner: 'L' + random bytes
	host    string
	pid     int64
	now     func() time.Time // monotonic durations only; injectable for tests

	mu      sync.Mutex
	queues  map[string]*queue                 // by key: in-process FIFO of waiters
	waiters map[string]map[chan struct{}]bool // by key: wake channels
	lis     *listener
	closed  bool

	// MySQL: statements prepared once (lazily, by the first exec of each query) and
	// reused on every connection. No mutex is ever held across I/O: a statement is
	// prepared outside any lock and published with LoadOrStore (the loser of a race
	// closes its copy). After Close (stmtClosed), exec no longer prepares and runs
	// its queries unprepared; a failed prepare is not remembered, the call simply
	// runs unprepared.
	stmts      sync.Map // query string -> *sql.Stmt
	stmtClosed atomic.Bool

	onTransient func(op string, err error) // test hook: a transient error is retried
}

// retryTransient runs f until it returns nil or an error that is not transient, at
// most maxTransient times, sleeping a short jittered backoff (or until ctx ends)
// between attempts. It returns f's last error. f must be safe to repeat: every
// statement it sends is atomic, and a deadlock or lock wait timeout rolls the
// statement back.
func (l *Locker) retryTransient(ctx context.Context, op string, f func() error) error {
	for attempt := 1; ; attempt++ {
		err := f()
		if err == nil || !sqlerr.Transient(err) || attempt >= maxTransient {
			return err
		}
		l.transient(op, err)
		if backoff.Sleep(ctx, transientPolicy.Delay(attempt-1), nil) != nil {
			return err
		}
	}
}

// transient notes a transient error about to be retried.
func (l *Locker) transient(op string, err error) {
	l.cfg.logger.Debug("sqllock/uniqueindex: transient error, retrying", "op", op, "err", err)
	if l.onTransient != nil {
		l.onTransient(op, err)
	}
}

// New returns a Locker on db, which must have been migrated (migrations.Up). It
// returns an error matching sqllock.ErrInvalidOption for an invalid dialect or option.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := config{ttl: DefaultTTL, poll: DefaultPollInterval, attempt: DefaultAttemptTimeout}
	for _, o := range opts {
		o(&cfg)
	}
	bad := func(format string, a ...any) (*Locker, error) {
		return nil, &sqllock.Error{Op: "new", Dialect: d, Kind: sqllock.ErrInvalidOption, Err: fmt.Errorf(format, a...)}
	}
	switch {
	case db == nil:
		return bad("nil *sql.DB")
	case !d.Valid():
		return bad("unknown dialect %v", d)
	case cfg.ttl <= 0:
		return bad("TTL %v is not positive", cfg.ttl)
	case cfg.renew < 0:
		return bad("renewal interval %v is negative", cfg.renew)
	case cfg.poll <= 0:
		return bad("poll interval %v is not positive", cfg.poll)
	case cfg.attempt <= 0:
		return bad("attempt timeout %v is not positive", cfg.attempt)
	}
	if cfg.renew == 0 {
		cfg.renew = cfg.ttl / 3
	}
	if cfg.ttl < 2*cfg.renew {
		return bad("TTL %v is shorter than twice the renewal interval %v", cfg.ttl, cfg.renew)
	}
	if cfg.ttl < 10*time.Millisecond {
		return bad("TTL %v is shorter than 10ms", cfg.ttl)
	}
	if cfg.logger == nil {
		cfg.logger = slog.Default()
	}
	id := make([]byte, 17)
	id[0] = 'L'
	rand.Read(id[1:])
	host, _ := os.Hostname()
	if len(host) > 255 {
		host = host[:255]
	}
	return &Locker{
		db: db, dialect: d, cfg: cfg, owner: id, host: host, pid: int64(os.Getpid()),
		now:     time.Now,
		queues:  map[string]*queue{},
		waiters: map[string]map[chan struct{}]bool{},
	}, nil
}

// Close stops the shared PostgreSQL listener and wakes the waiters, which go on by
// polling. Held leases are not released. Close is idempotent.
func (l *Locker) Close() error {
	l.mu.Lock()
	lis := l.lis
	l.lis = nil
	l.closed = true
	l.mu.Unlock()
	if lis != nil {
		lis.stop()
	}
	// Close the prepared statements without waiting for statements in flight
	// (sql.Stmt.Close waits for them): a renewal or attempt must never wait for
	// Close, nor Close for them.
	l.stmtClosed.Store(true)
	var sts []*sql.Stmt
	l.stmts.Range(func(k, v any) bool {
		if l.stmts.CompareAndDelete(k, v) {
			sts = append(sts, v.(*sql.Stmt))
		}
		return true
	})
	if len(sts) > 0 {
		go func() {
			for _, st := range sts {
				st.Close()
			}
		}()
	}
	return nil
}

// exec runs query on the pool. On MySQL it uses a statement prepared once per Locker:
// go-sql-driver otherwise prepares, executes and closes a statement for every call
// with arguments (three round trips instead of one).
func (l *Locker) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if l.dialect != sqllock.MySQL {
		return l.db.ExecContext(ctx, query, args...)
	}
	if st := l.stmt(ctx, query); st != nil {
		res, err := st.ExecContext(ctx, args...)
		if err == nil || !l.stmtClosed.Load() || err.Error() != "sql: statement is closed" {
			return res, err
		}
		// Closed by Close meanwhile: run it unprepared.
	}
	return l.db.ExecContext(ctx, query, args...)
}

// stmt returns the prepared statement of query, preparing it if needed, or nil after
// Close or if preparing failed. It holds no lock.
func (l *Locker) stmt(ctx context.Context, query string) *sql.Stmt {
	if v, ok := l.stmts.Load(query); ok {
		return v.(*sql.Stmt)
	}
	if l.stmtClosed.Load() {
		return nil
	}
	st, err := l.db.PrepareContext(ctx, query)
	if err != nil {
		return nil
	}
	if v, loaded := l.stmts.LoadOrStore(query, st); loaded {
		st.Close() // not used by anyone yet
		return v.(*sql.Stmt)
	}
	if l.stmtClosed.Load() && l.stmts.CompareAndDelete(query, st) {
		// Close ran meanwhile and may not have seen it: this call owns it, unused.
		st.Close()
		return nil
	}
	return st
}

// Acquire waits until the lock name is held, or ctx ends. See sqllock.Locker.
// sqllock.WithOwner makes the acquisition reentrant; sqllock.WithTTL overrides the
// lease time (its renewal interval is then a third of it).
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
	token     int64
	remaining time.Duration // holder's remaining lease, 0 if unknown
}

func (l *Locker) errorf(op, name string, kind, err error) error {
	return &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Kind: kind, Err: err}
}

func (l *Locker) acquire(ctx context.Context, op, name string, opts []sqllock.AcquireOption, wait bool) (*Lease, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return nil, err
	}
	ac, err := sqllock.ApplyAcquireOptions(op, l.dialect, name, opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
	}
	ttl, renew := l.cfg.ttl, l.cfg.renew
	if ac.TTL > 0 {
		ttl, renew = ac.TTL, ac.TTL/3
		if ttl < 10*time.Millisecond {
			return nil, l.errorf(op, name, sqllock.ErrInvalidOption, fmt.Errorf("TTL %v is shorter than 10ms", ttl))
		}
	}
	owner, reentrant := l.owner, false
	if ac.Owner != "" {
		owner, reentrant = append([]byte{'K'}, ac.Owner...), true
	}
	key := namekey.Key(name)
	skey := string(key)

	// Waiters of this Locker queue in the process; the first sends attempts. A
	// reentrant acquisition must not queue behind its own owner's hold.
	var slot *queue
	if wait && !reentrant {
		slot, err = l.enqueue(ctx, skey)
		if err != nil {
			return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
		}
	}
	freeSlot := func() {
		if slot != nil {
			l.dequeue(skey, slot)
			slot = nil
		}
	}
	var wake chan struct{}
	if wait {
		wake = l.subscribe(skey)
		defer l.unsubscribe(skey, wake)
	}

	pol := backoff.Policy{Min: 2 * time.Millisecond, Max: l.cfg.poll}
	transient := 0
	for attempt := 0; ; attempt++ {
		start := l.now()
		res, err := l.attempt(ctx, key, name, owner, ttl, reentrant)
		switch {
		case err == nil && res.ok:
			le := l.newLease(name, key, owner, res.token, ttl, renew, reentrant, start, slot)
			if ctx.Err() != nil {
				// Granted as ctx ended: give it back, leave nothing behind.
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.attempt)
				le.Release(rctx)
				cancel()
				return nil, l.errorf(op, name, sqllock.ErrNotAcquired, ctx.Err())
			}
			return le, nil
		case err == nil:
			transient = 0
		case sqlerr.Transient(err):
			// A conflict with a concurrent attempt, release, renewal or sweep: it means
			// "not acquired yet", never an error of the caller's.
			transient++
			if !wait && transient >= maxTransient {
				freeSlot()
				return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
			}
			l.transient(op, err)
			if !wait {
				if err := backoff.Sleep(ctx, transientPolicy.Delay(transient-1), nil); err != nil {
					return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
				}
				continue
			}
		case ctx.Err() == nil && attemptTimedOut(err):
			// The attempt ran past the attempt timeout (typically waiting for a row lock
			// held by the holder's Check transaction) while the caller's ctx is alive:
			// not acquired yet. The statement was cancelled and rolled back.
			if !wait {
				return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
			}
			l.cfg.logger.Debug("sqllock/uniqueindex: attempt timed out, retrying", "name", name, "err", err)
		case wait && sqlerr.Is(err, sqlerr.SessionLost) && ctx.Err() == nil:
			// The server restarted or the connection was cut: keep waiting.
			l.cfg.logger.Debug("sqllock/uniqueindex: attempt failed, retrying", "name", name, "err", err)
		default:
			freeSlot()
			if ctx.Err() != nil {
				return nil, l.errorf(op, name, sqllock.ErrNotAcquired, ctx.Err())
			}
			return nil, l.errorf(op, name, nil, err)
		}
		if !wait {
			return nil, l.errorf(op, name, sqllock.ErrNotAcquired, errors.New("held by another owner"))
		}
		d := pol.Delay(attempt)
		if l.dialect == sqllock.Postgres {
			l.listen()
			// Woken by NOTIFY; poll slowly in case it was lost, and at the holder's
			// expiry in case the holder died.
			d = backoff.Policy{Min: l.cfg.poll / 2, Max: l.cfg.poll}.Delay(1)
			if res.remaining > 0 && res.remaining+time.Millisecond < d {
				d = res.remaining + time.Millisecond
			}
			if err != nil {
				d = pol.Delay(attempt)
			}
		}
		if err := backoff.Sleep(ctx, d, wake); err != nil {
			freeSlot()
			return nil, l.errorf(op, name, sqllock.ErrNotAcquired, err)
		}
	}
}

// attemptTimedOut reports whether err is the end of an attempt cut by the attempt
// timeout: the context's error, or the server's "statement cancelled" (57014, 1317).
func attemptTimedOut(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		sqlerr.Is(err, sqlerr.Canceled)
}

// attempt makes one attempt. It runs detached from ctx (bounded by the attempt
// timeout) so that a grant is never lost in flight: the caller releases it if ctx
// ended meanwhile.
func (l *Locker) attempt(ctx context.Context, key []byte, name string, owner []byte, ttl time.Duration, reentrant bool) (attemptResult, error) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.attempt)
	defer cancel()
	us := ttl.Microseconds()
	if l.dialect == sqllock.Postgres {
		var tok, holds, rem int64
		err := l.db.QueryRowContext(actx, acquirePostgres, key, []byte(name), owner, us, reentrant, l.host, l.pid).Scan(&tok, &holds, &rem)
		if errors.Is(err, sql.ErrNoRows) {
			return attemptResult{}, nil
		}
		if err != nil {
			return attemptResult{}, err
		}
		return attemptResult{ok: tok > 0, token: tok, remaining: time.Duration(rem) * time.Microsecond}, nil
	}
	t, err := l.fenceNext(actx, key, name)
	if err != nil {
		return attemptResult{}, err
	}
	res, err := l.exec(actx, acquireMySQL, owner, us, l.host, l.pid, key, t, reentrant, reentrant, reentrant)
	if err != nil {
		return attemptResult{}, err
	}
	id, err := res.LastInsertId()
	if err != nil {
		return attemptResult{}, err
	}
	if id > 0 { // the update branch ran: see acquireMySQL
		return attemptResult{ok: id%2 == 1, token: id / 2}, nil
	}
	n, err := res.RowsAffected()
	if err != nil {
		return attemptResult{}, err
	}
	// Inserted (1 row), or overtaken by a later fence increment (no row): the same
	// count with or without clientFoundRows.
	return attemptResult{ok: n == 1, token: t}, nil
}

// fenceNext is fence.Next on MySQL, through a prepared statement.
func (l *Locker) fenceNext(ctx context.Context, key []byte, name string) (int64, error) {
	res, err := l.exec(ctx, fence.NextMySQL, key, []byte(name))
	if err != nil {
		return 0, err
	}
	return fence.MySQLToken(res)
}

// queue is the in-process FIFO of one Locker's waiters for one key: a one-slot
// channel whose blocked senders the Go runtime serves in order.
type queue struct {
	slot chan struct{}
	refs int
}

func (l *Locker) enqueue(ctx context.Context, key string) (*queue, error) {
	l.mu.Lock()
	q := l.queues[key]
	if q == nil {
		q = &queue{slot: make(chan struct{}, 1)}
		l.queues[key] = q
	}
	q.refs++
	l.mu.Unlock()
	select {
	case q.slot <- struct{}{}:
		return q, nil
	case <-ctx.Done():
		l.unref(key, q)
		return nil, ctx.Err()
	}
}

func (l *Locker) dequeue(key string, q *queue) {
	<-q.slot
	l.unref(key, q)
}

func (l *Locker) unref(key string, q *queue) {
	l.mu.Lock()
	q.refs--
	if q.refs == 0 && l.queues[key] == q {
		delete(l.queues, key)
	}
	l.mu.Unlock()
}

// subscribe registers a wake channel for key, and starts the listener on PostgreSQL.
func (l *Locker) subscribe(key string) chan struct{} {
	ch := make(chan struct{}, 1)
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.waiters[key]
	if m == nil {
		m = map[chan struct{}]bool{}
		l.waiters[key] = m
	}
	m[ch] = true
	return ch
}

// listen starts the shared listener on PostgreSQL, once a waiter has to wait.
func (l *Locker) listen() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.dialect == sqllock.Postgres && l.lis == nil && !l.closed {
		l.lis = startListener(l)
	}
}

func (l *Locker) unsubscribe(key string, ch chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m := l.waiters[key]; m != nil {
		delete(m, ch)
		if len(m) == 0 {
			delete(l.waiters, key)
		}
	}
}

// wake wakes the waiters of key, or every waiter if all.
func (l *Locker) wake(key string, all bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	poke := func(m map[chan struct{}]bool) {
		for ch := range m {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
	if all {
		for _, m := range l.waiters {
			poke(m)
		}
		return
	}
	poke(l.waiters[key])
}

// Sweeper deletes expired lease rows for the reaper package (it implements
// reaper.Sweeper).
type Sweeper struct {
	db      *sql.DB
	dialect sqllock.Dialect
	grace   time.Duration
}

// NewSweeper returns the Sweeper of the lease table: each batch deletes rows whose
// lease expired more than grace ago by the database clock, in short statements that
// lock only the rows they delete (see SweepBatch). Tokens are unaffected: they live
// in sqllock_fence, which is never swept.
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
// candidates without locking, then deletes them by primary key in one statement that
// re-checks their expiry, locking only those rows and no index range, so that live
// leases (their Release, renewal or takeover) are never blocked by a sweep. A
// deadlock or lock wait timeout is returned as is; the reaper retries the batch.
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
	keys, err := s.candidates(ctx, us, limit)
	if err != nil || len(keys) == 0 {
		return 0, false, err
	}
	var q strings.Builder
	q.Grow(len(sweepDeleteMySQL) + 2*len(keys) + 1)
	q.WriteString(sweepDeleteMySQL)
	args := make([]any, 0, len(keys)+1)
	args = append(args, us)
	for i, k := range keys {
		if i > 0 {
			q.WriteByte(',')
		}
		q.WriteByte('?')
		args = append(args, k)
	}
	q.WriteByte(')')
	res, err := s.db.ExecContext(ctx, q.String(), args...)
	if err != nil {
		return 0, false, err
	}
	n, err := res.RowsAffected()
	return int(n), len(keys) >= limit, err
}

// candidates returns the keys of at most limit rows expired more than us µs ago, read
// without locks (a consistent read).
func (s *Sweeper) candidates(ctx context.Context, us int64, limit int) ([][]byte, error) {
	rows, err := s.db.QueryContext(ctx, sweepSelectMySQL, us, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	keys := make([][]byte, 0, min(limit, 1024))
	for rows.Next() {
		var k []byte
		if err := rows.Scan(&k); err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, rows.Err()
}

// hexKey is the NOTIFY payload of a key.
func hexKey(key []byte) string { return hex.EncodeToString(key) }
