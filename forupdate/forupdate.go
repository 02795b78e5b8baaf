package forupdate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Defaults of the options.
const (
	// DefaultKeepalive is how often a lease checks, from another pooled connection,
	// that its session is still alive.
	DefaultKeepalive = 5 * time.Second

	// DefaultMaxWaiters is the cap on waiters blocked in the database per Locker when
	// the pool has no MaxOpenConns limit at the time New is called. With a limit, the
	// default is half of it (at least 1).
	DefaultMaxWaiters = 64
)

// Option configures a Locker. Options are validated by New.
type Option func(*config)

type config struct {
	isolation  sql.IsolationLevel
	maxWaiters int
	keepalive  time.Duration
	logger     *slog.Logger
	err        error
}

func (c *config) fail(format string, args ...any) {
	if c.err == nil {
		c.err = &sqllock.Error{Op: "new", Kind: sqllock.ErrInvalidOption, Err: fmt.Errorf(format, args...)}
	}
}

// WithIsolation sets the isolation level of the lock transactions:
// sql.LevelDefault (the server's default, READ COMMITTED on PostgreSQL and REPEATABLE
// READ on InnoDB), sql.LevelReadCommitted, sql.LevelRepeatableRead or
// sql.LevelSerializable. See the package documentation for what reads inside the
// transaction see. On MySQL a level other than the default costs one more statement
// per acquisition (SET TRANSACTION ISOLATION LEVEL).
func WithIsolation(level sql.IsolationLevel) Option {
	return func(c *config) {
		switch level {
		case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
			c.isolation = level
		default:
			c.fail("isolation level %v is not supported", level)
		}
	}
}

// WithMaxWaiters caps the number of Acquire calls of this Locker that wait for a row
// lock in the database at once, each on a pooled connection. Further callers wait in
// the process, in arrival order, without a connection; before they do, they make one
// NOWAIT attempt, so a free name is never delayed by waiters of a busy one. Set it
// well below the pool's MaxOpenConns, leaving room for holders and the rest of the
// application. Default: half of db's MaxOpenConns when New is called, or
// DefaultMaxWaiters for an unlimited pool.
func WithMaxWaiters(n int) Option {
	return func(c *config) {
		if n < 1 {
			c.fail("MaxWaiters %d is less than 1", n)
			return
		}
		c.maxWaiters = n
	}
}

// WithKeepalive sets how often a held lease checks that its session is alive, with a
// short query on another pooled connection (pg_stat_activity, PROCESSLIST). It bounds
// how long a lease whose session died goes on reporting itself held. Default
// DefaultKeepalive.
func WithKeepalive(interval time.Duration) Option {
	return func(c *config) {
		if interval <= 0 {
			c.fail("keepalive interval %v is not positive", interval)
			return
		}
		c.keepalive = interval
	}
}

// WithLogger sets the logger for keepalive failures and lost leases. Default: none.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) {
		if l == nil {
			c.fail("nil logger")
			return
		}
		c.logger = l
	}
}

// Locker takes forupdate locks on one database. It implements sqllock.Locker; Lock
// and TryLock return the concrete *Lease, whose Tx is the locking transaction. Build
// it once with New and share it: it is safe for concurrent use.
type Locker struct {
	db      *sql.DB
	dialect sqllock.Dialect
	cfg     config
	txOpts  *sql.TxOptions
	waiters chan struct{}
}

var _ sqllock.Locker = (*Locker)(nil)

// New returns a Locker on db, whose server is of dialect d and has the library's
// migrations applied (migrations.Up). It sends no SQL. Invalid options return an
// error matching sqllock.ErrInvalidOption.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := config{keepalive: DefaultKeepalive}
	if db == nil {
		cfg.fail("nil *sql.DB")
	}
	if !d.Valid() {
		cfg.fail("unknown dialect %v", d)
	}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.err != nil {
		return nil, cfg.err
	}
	if cfg.maxWaiters == 0 {
		cfg.maxWaiters = DefaultMaxWaiters
		if n := db.Stats().MaxOpenConnections; n > 0 {
			cfg.maxWaiters = max(1, n/2)
		}
	}
	if cfg.logger == nil {
		cfg.logger = slog.New(slog.DiscardHandler)
	}
	l := &Locker{db: db, dialect: d, cfg: cfg, waiters: make(chan struct{}, cfg.maxWaiters)}
	if cfg.isolation != sql.LevelDefault {
		l.txOpts = &sql.TxOptions{Isolation: cfg.isolation}
	}
	return l, nil
}

// MaxWaiters returns the cap on waiters blocked in the database (WithMaxWaiters).
func (l *Locker) MaxWaiters() int { return l.cfg.maxWaiters }

// Acquire is Lock, returning the lease as a sqllock.Lease (its dynamic type is *Lease).
func (l *Locker) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	lease, err := l.Lock(ctx, name, opts...)
	if err != nil {
		return nil, err
	}
	return lease, nil
}

// TryAcquire is TryLock, returning the lease as a sqllock.Lease.
func (l *Locker) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	lease, err := l.TryLock(ctx, name, opts...)
	if err != nil {
		return nil, err
	}
	return lease, nil
}

// Lock waits until it holds the lock name or ctx ends, and returns the lease, whose
// Tx is the open transaction holding the row lock. The waiting happens in the
// database, on one pooled connection (see WithMaxWaiters). On PostgreSQL a deadline of
// ctx becomes the statement's lock_timeout; on MySQL, and when ctx is cancelled, the
// waiting statement is interrupted with KILL QUERY or pg_cancel_backend from another
// pooled connection, so the wait ends within milliseconds of ctx and no waiter is left
// queued on the server. When ctx ends first, the error matches both
// sqllock.ErrNotAcquired and ctx.Err(), and no lock is held, even if the database
// granted it at that instant. Deadlocks, serialization failures and server lock wait
// timeouts are retried. sqllock.WithOwner and sqllock.WithTTL are not supported: the
// lock lives as long as its transaction.
func (l *Locker) Lock(ctx context.Context, name string, opts ...sqllock.AcquireOption) (*Lease, error) {
	const op = "acquire"
	if err := l.check(op, name, opts); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, l.notAcquired(op, name, err)
	}
	select {
	case l.waiters <- struct{}{}:
	default:
		// Every waiter slot is taken. Try once without waiting: a free name must not
		// queue behind the waiters of a busy one.
		lease, err := l.TryLock(ctx, name)
		if err == nil || !errors.Is(err, sqllock.ErrNotAcquired) || ctx.Err() != nil {
			return lease, err
		}
		select {
		case l.waiters <- struct{}{}:
		case <-ctx.Done():
			return nil, l.notAcquired(op, name, ctx.Err())
		}
	}
	var slotOnce sync.Once
	freeSlot := func() { slotOnce.Do(func() { <-l.waiters }) }
	defer freeSlot()
	return l.acquireLoop(ctx, op, name, modeWait, freeSlot)
}

// TryLock makes one attempt to take the lock name without waiting for a holder
// (FOR UPDATE NOWAIT) and returns an error matching sqllock.ErrNotAcquired at once if
// the lock is held. It waits only for a connection from the pool.
func (l *Locker) TryLock(ctx context.Context, name string, opts ...sqllock.AcquireOption) (*Lease, error) {
	const op = "try-acquire"
	if err := l.check(op, name, opts); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, l.notAcquired(op, name, err)
	}
	return l.acquireLoop(ctx, op, name, modeTry, func() {})
}

// WithLock takes the lock name (waiting as Lock does), runs fn inside the locking
// transaction, and commits it if fn returns nil or rolls it back otherwise (also when
// fn panics). The context given to fn is cancelled, with cause sqllock.ErrLost, if
// the session is lost while fn runs; then nothing of fn's work commits and WithLock
// returns an error matching sqllock.ErrLost. fn must not commit or roll back tx.
func (l *Locker) WithLock(ctx context.Context, name string, fn func(ctx context.Context, tx *sql.Tx) error, opts ...sqllock.AcquireOption) (err error) {
	lease, err := l.Lock(ctx, name, opts...)
	if err != nil {
		return err
	}
	return lease.run(ctx, fn)
}

// TryAcquireAny takes whichever of names is free, with FOR UPDATE SKIP LOCKED: the
// job-claim pattern. On PostgreSQL it prefers names in the order given; on MySQL in
// the order of their keys (an ORDER BY would make InnoDB lock every row it sorts). It does not wait for a
// holder; if every name is held it returns an error matching sqllock.ErrNotAcquired.
// The lease's Name tells which name it holds. Names that were never used are created
// first (costing one more round trip for each missing row).
func (l *Locker) TryAcquireAny(ctx context.Context, names []string) (*Lease, error) {
	const op = "try-acquire-any"
	if len(names) == 0 {
		return nil, &sqllock.Error{Op: op, Dialect: l.dialect, Kind: sqllock.ErrInvalidName, Err: errors.New("no names")}
	}
	keys := make([][]byte, len(names))
	byKey := make(map[string]string, len(names))
	for i, n := range names {
		if err := sqllock.ValidateName(n); err != nil {
			return nil, err
		}
		keys[i] = namekey.Key(n)
		byKey[string(keys[i])] = n
	}
	if err := ctx.Err(); err != nil {
		return nil, l.notAcquired(op, "", err)
	}
	for attempt := 0; ; attempt++ {
		lease, err := l.anyAttempt(ctx, op, keys, names, byKey)
		if err == nil || attempt >= maxTryAttempts || !errors.Is(err, errRetry) {
			if errors.Is(err, errRetry) {
				err = &sqllock.Error{Op: op, Dialect: l.dialect, Kind: sqllock.ErrNotAcquired, Err: errors.Unwrap(err)}
			}
			return lease, err
		}
	}
}

type mode int

const (
	modeWait mode = iota
	modeTry
)

// maxTryAttempts bounds the attempts of TryLock and TryAcquireAny after transient
// errors (deadlock, serialization failure, a row created concurrently).
const maxTryAttempts = 3

// retryPolicy spaces attempts after deadlocks and repeated conflicts.
var retryPolicy = backoff.Policy{Min: time.Millisecond, Max: 100 * time.Millisecond}

// errRetry marks an attempt that met a transient conflict; the cause is wrapped.
var errRetry = errors.New("retry")

type retryErr struct{ cause error }

func (e retryErr) Error() string        { return "retry: " + e.cause.Error() }
func (e retryErr) Is(target error) bool { return target == errRetry }
func (e retryErr) Unwrap() error        { return e.cause }

func (l *Locker) check(op, name string, opts []sqllock.AcquireOption) error {
	if err := sqllock.ValidateName(name); err != nil {
		return err
	}
	cfg, err := sqllock.ApplyAcquireOptions(opts)
	if err != nil {
		return err
	}
	if cfg.Owner != "" || cfg.TTL != 0 {
		return &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Kind: sqllock.ErrInvalidOption,
			Err: errors.New("forupdate locks support neither WithOwner nor WithTTL")}
	}
	return nil
}

func (l *Locker) notAcquired(op, name string, cause error) error {
	return &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Kind: sqllock.ErrNotAcquired, Err: cause}
}

// acquireLoop makes attempts until one holds the lock, the lock is busy (modeTry), ctx
// ends or an error that is not transient occurs. granted is called as soon as the
// row lock is held.
func (l *Locker) acquireLoop(ctx context.Context, op, name string, m mode, granted func()) (*Lease, error) {
	key := namekey.Key(name)
	var conflicts, lostSessions int
	for {
		lease, err := l.attempt(ctx, op, name, key, m, granted)
		if err == nil {
			return lease, nil
		}
		if ctx.Err() != nil && !errors.Is(err, sqllock.ErrInvalidName) {
			// Whatever happened, ctx ended during the attempt: report that.
			return nil, l.notAcquired(op, name, ctx.Err())
		}
		if !errors.Is(err, errRetry) {
			return nil, err
		}
		cause := errors.Unwrap(err)
		if sqlerr.Is(cause, sqlerr.SessionLost) {
			// A dead pooled connection: database/sql discards it; take another.
			if lostSessions++; lostSessions > 3 {
				return nil, &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Err: cause}
			}
			continue
		}
		if m == modeTry && sqlerr.Is(cause, sqlerr.LockTimeout) {
			return nil, l.notAcquired(op, name, cause) // NOWAIT: the lock is held
		}
		conflicts++
		if m == modeTry && conflicts >= maxTryAttempts {
			return nil, l.notAcquired(op, name, cause)
		}
		// Serialization failures (REPEATABLE READ on PostgreSQL) mean the holder just
		// committed: retry at once, then back off if they keep coming.
		if conflicts > 2 || sqlerr.Is(cause, sqlerr.Deadlock) {
			if err := backoff.Sleep(ctx, retryPolicy.Delay(conflicts), nil); err != nil {
				return nil, l.notAcquired(op, name, err)
			}
		}
	}
}

// waitTarget identifies a statement that may wait, so that it can be interrupted
// from another connection: the backend pid on PostgreSQL, a marker comment in the
// statement text on MySQL.
type waitTarget struct {
	pid    int64
	marker string
}

// attempt makes one acquisition attempt on a fresh pooled connection.
func (l *Locker) attempt(ctx context.Context, op, name string, key []byte, m mode, granted func()) (lease *Lease, err error) {
	conn, err := l.db.Conn(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		return nil, &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Err: err}
	}
	keep := false
	defer func() {
		if !keep {
			conn.Close()
		}
	}()
	target := waitTarget{marker: newMarker()}
	if l.dialect == sqllock.Postgres {
		if target.pid, err = pgSessionID(ctx, conn); err != nil {
			return nil, l.classify(op, name, err)
		}
	}
	for created := false; ; created = true {
		// The transaction outlives ctx: it is the lease. database/sql rolls a
		// transaction back when its context ends, so give it one that does not.
		tx, err := conn.BeginTx(context.WithoutCancel(ctx), l.txOpts)
		if err != nil {
			return nil, l.classify(op, name, err)
		}
		sid, token, err := l.lockRow(ctx, tx, target, key, name, m, granted)
		if err == nil {
			if ctx.Err() != nil {
				// Granted at the instant ctx ended: give it back.
				tx.Rollback()
				return nil, l.notAcquired(op, name, ctx.Err())
			}
			keep = true
			return l.newLease(name, token, sid, conn, tx), nil
		}
		// Whatever failed, end the whole transaction: on MySQL a lock wait timeout
		// rolls back only the statement, and a missing row may have left a gap lock.
		tx.Rollback()
		if !errors.Is(err, errNoRow) {
			return nil, l.classify(op, name, err)
		}
		if created {
			return nil, &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Err: errors.New("lock row still missing after it was created")}
		}
		if err := l.createRow(ctx, conn, target, key, name, m); err != nil {
			return nil, l.classify(op, name, err)
		}
	}
}

// classify turns a database error of an attempt into a retryErr (transient: a new
// attempt may succeed), an ErrNotAcquired (busy) or an *sqllock.Error.
func (l *Locker) classify(op, name string, err error) error {
	var se *sqllock.Error
	if errors.As(err, &se) {
		return err
	}
	switch sqlerr.Classify(err) {
	case sqlerr.Deadlock, sqlerr.Serialization, sqlerr.Duplicate, sqlerr.LockTimeout, sqlerr.Canceled, sqlerr.SessionLost:
		return retryErr{err}
	}
	return &sqllock.Error{Op: op, Dialect: l.dialect, Name: name, Err: err}
}

// lockRow takes the row lock of key in tx, then draws the new token and stores it
// in the row. It returns the session id and the token, errNoRow if the row does not
// exist, and in modeTry a LockTimeout-class error when the row is locked. granted is
// called as soon as the row lock is held.
func (l *Locker) lockRow(ctx context.Context, tx *sql.Tx, target waitTarget, key []byte, name string, m mode, granted func()) (sid, token int64, err error) {
	// Statements that do not wait get ctx; the waiting one gets a context that does
	// not end and is interrupted by watched (drivers close the connection when a
	// statement's context ends, which would leave the waiter queued on the server).
	nctx := context.WithoutCancel(ctx)
	if l.dialect == sqllock.Postgres {
		sid = target.pid
		var one int
		bump := pgBump
		if m == modeTry {
			err = tx.QueryRowContext(ctx, pgTry, key).Scan(&one)
		} else {
			query, args := pgLock, []any{key}
			if deadline, ok := ctx.Deadline(); ok {
				ms := time.Until(deadline).Milliseconds() + 1
				if ms <= 1 {
					return 0, 0, context.DeadlineExceeded
				}
				query, args, bump = pgLockTimeout, []any{key, fmt.Sprintf("%dms", ms)}, pgBumpReset
			}
			err = l.watched(ctx, target, func() error { return tx.QueryRowContext(nctx, query, args...).Scan(&one) })
		}
		if errors.Is(err, sql.ErrNoRows) {
			return 0, 0, errNoRow
		}
		if err != nil {
			return 0, 0, err
		}
		granted()
		err = tx.QueryRowContext(nctx, bump, key).Scan(&token)
		return sid, token, err
	}
	if m == modeTry {
		err = tx.QueryRowContext(ctx, myTry, key).Scan(&sid)
	} else {
		query := fmt.Sprintf(myLockFmt, target.marker)
		err = l.watched(ctx, target, func() error { return tx.QueryRowContext(nctx, query, key).Scan(&sid) })
	}
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, errNoRow
	}
	if err != nil {
		return 0, 0, err
	}
	granted()
	token, err = myReplace(nctx, tx, key, name)
	return sid, token, err
}

// myReplace replaces the locked row of key (see myBump) and returns its new token.
func myReplace(ctx context.Context, tx *sql.Tx, key []byte, name string) (int64, error) {
	res, err := tx.ExecContext(ctx, myBump, key, []byte(name))
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

// createRow creates the row of key in autocommit. On MySQL an INSERT that meets an
// existing row waits for that row's lock (InnoDB's duplicate check takes a shared
// lock); the statement is then interrupted when ctx ends, and in modeTry after a
// short bound, which means the row exists.
func (l *Locker) createRow(ctx context.Context, conn *sql.Conn, target waitTarget, key []byte, name string, m mode) error {
	if l.dialect == sqllock.Postgres {
		return createRow(ctx, conn, l.dialect, key, name, "")
	}
	wctx := ctx
	if m == modeTry {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, tryCreateWait)
		defer cancel()
	}
	err := l.watched(wctx, target, func() error {
		return createRow(context.WithoutCancel(ctx), conn, l.dialect, key, name, target.marker)
	})
	if err != nil && wctx.Err() != nil && ctx.Err() == nil {
		return nil // the row exists and is held; the next attempt will say so
	}
	return err
}

// tryCreateWait bounds how long TryLock waits for an INSERT on MySQL that met a
// row created and locked by another client in the meantime.
const tryCreateWait = 500 * time.Millisecond

// cancelGrace is how long after a ctx deadline a PostgreSQL statement that has a
// lock_timeout of its own is given before it is cancelled from outside.
const cancelGrace = 200 * time.Millisecond

// watched runs stmt, a statement that may wait for a lock (identified by target), and
// interrupts it from another pooled connection if ctx ends first. The statement must
// run with a context that does not end (drivers close the connection when the
// statement's context ends, which leaves the server-side waiter queued).
func (l *Locker) watched(ctx context.Context, target waitTarget, stmt func() error) error {
	if ctx.Done() == nil {
		return stmt()
	}
	var mu sync.Mutex
	finished := false
	stop := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		select {
		case <-stop:
			return
		case <-ctx.Done():
		}
		if l.dialect == sqllock.Postgres && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			// lock_timeout ends the wait on the server; cancel only as a backstop.
			t := time.NewTimer(cancelGrace)
			defer t.Stop()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if finished {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := cancelStatement(cctx, l.db, l.dialect, target.pid, target.marker); err != nil {
			l.cfg.logger.Warn("sqllock/forupdate: cancelling a lock wait failed", "target", target, "err", err)
		}
	}()
	err := stmt()
	// No other statement may start on the session while a cancel of this one is on
	// its way: wait for it to complete. A cancel that arrives between statements is
	// ignored by both servers.
	mu.Lock()
	finished = true
	mu.Unlock()
	close(stop)
	<-exited
	return err
}

// anyAttempt makes one TryAcquireAny attempt.
func (l *Locker) anyAttempt(ctx context.Context, op string, keys [][]byte, names []string, byKey map[string]string) (*Lease, error) {
	conn, err := l.db.Conn(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, l.notAcquired(op, "", ctx.Err())
		}
		return nil, &sqllock.Error{Op: op, Dialect: l.dialect, Err: err}
	}
	keep := false
	defer func() {
		if !keep {
			conn.Close()
		}
	}()
	fail := func(err error) (*Lease, error) {
		if ctx.Err() != nil {
			return nil, l.notAcquired(op, "", ctx.Err())
		}
		err = l.classify(op, "", err)
		return nil, err
	}
	target := waitTarget{marker: newMarker()}
	if l.dialect == sqllock.Postgres {
		if target.pid, err = pgSessionID(ctx, conn); err != nil {
			return fail(err)
		}
	}
	for created := false; ; created = true {
		tx, err := conn.BeginTx(context.WithoutCancel(ctx), l.txOpts)
		if err != nil {
			return fail(err)
		}
		var key []byte
		var token, sid int64
		if l.dialect == sqllock.Postgres {
			sid = target.pid
			err = tx.QueryRowContext(ctx, pgAny, keys).Scan(&key)
			if err == nil {
				err = tx.QueryRowContext(ctx, pgBump, key).Scan(&token)
			}
		} else {
			var name []byte
			q := fmt.Sprintf(myAnyFmt, placeholders(len(keys)))
			err = tx.QueryRowContext(ctx, q, anyArgs(keys, 1)...).Scan(&key, &name, &sid)
			if err == nil {
				token, err = myReplace(ctx, tx, key, string(name))
			}
		}
		if err == nil && ctx.Err() == nil {
			keep = true
			return l.newLease(byKey[string(key)], token, sid, conn, tx), nil
		}
		tx.Rollback()
		if !errors.Is(err, sql.ErrNoRows) {
			if err == nil {
				err = ctx.Err()
			}
			return fail(err)
		}
		// Nothing free: every row is locked, or some rows do not exist yet.
		missing, err := missingRows(ctx, conn, l.dialect, keys)
		if err != nil {
			return fail(err)
		}
		if len(missing) == 0 || created {
			return nil, l.notAcquired(op, "", errors.New("every name is held"))
		}
		for _, i := range missing {
			if err := l.createRow(ctx, conn, target, keys[i], names[i], modeTry); err != nil {
				return fail(err)
			}
		}
	}
}
