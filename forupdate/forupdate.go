package forupdate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/deploy"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Defaults of the options.
const (
	// DefaultTTL is the server-enforced bound of a lock transaction: the server ends a
	// lock transaction that stays idle (no statement) for longer, which frees the
	// lock, so a holder cut off from the database loses the lock on the server within
	// it. The holder gives the lease up on its own clock TTL/5 earlier.
	DefaultTTL = 30 * time.Second

	// DefaultKeepalive is how often a lease checks, from another pooled connection,
	// that its transaction is still open and how long its bound has left.
	DefaultKeepalive = 5 * time.Second

	// DefaultMaxWaiters is the cap on waiters blocked in the database per Locker when
	// the pool has no MaxOpenConns limit at the time New is called. With a limit, the
	// default is half of it (at least 1).
	DefaultMaxWaiters = 64
)

// Option configures a Locker. Options are validated by New.
type Option func(*config) error

type config struct {
	lease.Config
	noToken    bool
	isolation  sql.IsolationLevel
	maxWaiters int
}

// WithIsolation sets the isolation level of the lock transactions:
// sql.LevelDefault (the server's default, READ COMMITTED on PostgreSQL and REPEATABLE
// READ on InnoDB), sql.LevelReadCommitted, sql.LevelRepeatableRead or
// sql.LevelSerializable. See the package documentation for what reads inside the
// transaction see. On MySQL a level other than the default costs one more statement
// per acquisition (SET TRANSACTION ISOLATION LEVEL).
func WithIsolation(level sql.IsolationLevel) Option {
	return func(c *config) error {
		switch level {
		case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
			c.isolation = level
			return nil
		}
		return fmt.Errorf("isolation level %v is not supported", level)
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
	return func(c *config) error {
		if n < 1 {
			return fmt.Errorf("MaxWaiters %d is less than 1", n)
		}
		c.maxWaiters = n
		return nil
	}
}

// WithTTL sets the server-enforced bound of a lock transaction (DefaultTTL): the
// longest the transaction may stay idle before the server ends it
// (idle_in_transaction_session_timeout and tcp_user_timeout on PostgreSQL, set for
// the transaction only; wait_timeout and net_write_timeout on MySQL, in whole
// seconds, rounded up, put back when the connection returns to the pool). On
// PostgreSQL with pgx the keep-alive touches an idle transaction itself; on MySQL
// only the caller's statements do (see the package documentation).
func WithTTL(d time.Duration) Option { return func(c *config) error { return c.SetTTL(d) } }

// WithKeepalive sets how often a held lease checks its transaction, with a short
// query on another pooled connection (default DefaultKeepalive). It bounds how long a
// lease whose session was killed goes on reporting itself held. It must be at most
// half the TTL.
func WithKeepalive(interval time.Duration) Option {
	return func(c *config) error { return c.SetInterval(interval) }
}

// WithoutToken makes leases without a fencing token: Lease.Token returns 0 and the
// locking statement is a plain SELECT ... FOR UPDATE that writes nothing, the
// statement of a hand-written locking transaction. It is for callers who only need
// the lock to be atomic with the writes they make in Lease.Tx and who pass no fencing
// token to anything. The default draws a token in the locking statement (BEGIN, that
// statement and COMMIT either way; see the package documentation for the
// exceptions), which writes the row: on MySQL every acquisition then commits a
// durable write.
func WithoutToken() Option {
	return func(c *config) error { c.noToken = true; return nil }
}

// WithLogger sets the logger for keepalive failures and lost leases. Default: none.
func WithLogger(l *slog.Logger) Option { return func(c *config) error { return c.SetLogger(l) } }

// WithTelemetryNames records lock names in the OpenTelemetry spans (default: a hash
// of the name, since names can carry user data).
func WithTelemetryNames() Option { return func(c *config) error { return c.SetTelemetryNames() } }

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
	return func(c *config) error { return c.SetRequireSyncReplication() }
}

// WithGaleraSingleWriter accepts a MariaDB Galera node, which the Locker refuses by
// default (an error matching sqllock.ErrUnsafeDeployment from its first
// acquisition): a row lock taken by SELECT ... FOR UPDATE is local to one node, so clients on two nodes would both hold the
// lock. The option is your promise that every client of these locks reaches the same
// writer node (one node address, or a proxy that sends all writes to one node and
// fails over only when that node is gone, which ends its sessions and so its locks).
// The same promise accepts a MySQL Group Replication member of a multi-primary group
// or a secondary, which are refused the same way (a single-primary group's primary
// is accepted without it); a secondary is read-only, so forupdate's lock row cannot
// be written there even then.
func WithGaleraSingleWriter() Option {
	return func(c *config) error { return c.SetGaleraSingleWriter() }
}

// Locker takes forupdate locks on one database. It implements sqllock.Locker; Lock
// and TryLock return the concrete *Lease, whose Tx is the locking transaction. Build
// it once with New and share it: it is safe for concurrent use. Close it when done.
type Locker struct {
	db       *sql.DB
	dialect  sqllock.Dialect
	cfg      config
	txOpts   *sql.TxOptions
	waiters  chan struct{}
	pins     *pin.Pool
	pg       pgStatements
	myMaria  myStatements
	myOracle myStatements
	guard    *deploy.Guard

	queued atomic.Int64 // Lock calls waiting in the process for a waiter slot
	inDB   atomic.Int64 // statements that may wait for a lock, under way
	flavor atomic.Int32 // MySQL server flavour (flavor*), asked once
	// skipNowait counts the coming MySQL 8 acquisitions with a token and a deadline
	// that go straight to the bounded wait, without first trying to take the lock at
	// once (see lockRow): set when such a try found the lock held.
	skipNowait atomic.Int32
	// MySQL with tokens: the server runs' epochs (see raiseTokens); noRuns once the
	// server refused to record one (Group Replication, error 3098).
	myRun  fence.MySQLRun
	noRuns atomic.Bool
}

// skipNowaitAfterBusy is how many acquisitions skip the try at once after one found
// the lock held: under steady contention the try costs one statement in
// skipNowaitAfterBusy+1 acquisitions.
const skipNowaitAfterBusy = 16

// nowaitFirst reports whether a MySQL 8 acquisition with a token and a deadline should
// first try to take the lock at once (skipNowait).
func (l *Locker) nowaitFirst() bool {
	for {
		n := l.skipNowait.Load()
		if n <= 0 {
			return true
		}
		if l.skipNowait.CompareAndSwap(n, n-1) {
			return false
		}
	}
}

var _ sqllock.Locker = (*Locker)(nil)

// New returns a Locker on db, whose server is of dialect d and has the library's
// migrations applied (migrations.Up). It sends no SQL. Invalid options return an
// error matching sqllock.ErrInvalidOption.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := config{Config: lease.Config{Timing: lease.Timing{TTL: DefaultTTL, Interval: DefaultKeepalive}}}
	if err := lease.New("forupdate", db, d, &cfg, &cfg.Config, opts); err != nil {
		return nil, err
	}
	if d == sqllock.MySQL && cfg.Timing.TTL < time.Second {
		return nil, lease.NewError("new", d, "", sqllock.ErrInvalidOption, fmt.Errorf("forupdate: TTL %v is shorter than MySQL's smallest wait_timeout, 1s", cfg.Timing.TTL))
	}
	if cfg.maxWaiters == 0 {
		cfg.maxWaiters = DefaultMaxWaiters
		if n := db.Stats().MaxOpenConnections; n > 0 {
			cfg.maxWaiters = max(1, n/2)
		}
	}
	l := &Locker{
		db: db, dialect: d, cfg: cfg, waiters: make(chan struct{}, cfg.maxWaiters),
		pins: pin.New(db, d, cfg.Timing.TTL, cfg.Logger),
		pg:   newPgStatements(cfg.Timing.TTL, !cfg.noToken), myMaria: newMyStatements(flavorMariaDB), myOracle: newMyStatements(flavorMySQL8),
		guard: cfg.Guard(db, d, "forupdate", deploy.Needs{OneNode: true}),
	}
	if cfg.isolation != sql.LevelDefault {
		l.txOpts = &sql.TxOptions{Isolation: cfg.isolation}
	}
	if d == sqllock.MySQL && !cfg.noToken {
		l.myRun = fence.MySQLRun{NewestEpoch: cfg.GaleraSingleWriter}
		l.pins.OnSession([]string{l.myRun.EpochSQL(), myRaisedEpoch}, l.raiseTokens)
	}
	return l, nil
}

// Close returns the idle sessions the Locker keeps for reuse (MySQL) to the pool.
// Held leases stay valid until they end. Idempotent.
func (l *Locker) Close() error {
	l.pins.Close()
	return nil
}

// CommittedToken returns the token of the last committed acquisition of name: the
// way to tell, after Release reported ErrCommitUnknown, whether it committed (it did
// if and only if this is the lease's token). 0 if the name was never locked with a
// token.
func (l *Locker) CommittedToken(ctx context.Context, name string) (int64, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return 0, err
	}
	q := myCommitted
	if l.dialect == sqllock.Postgres {
		q = "SELECT token FROM sqllock_rowlock WHERE lock_key = $1"
	}
	var tok int64
	err := l.db.QueryRowContext(ctx, q, namekey.Key(name)).Scan(&tok)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, lease.NewError("committed-token", l.dialect, name, nil, err)
	}
	return tok, nil
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
// database, on one pooled connection (see WithMaxWaiters). A deadline of ctx becomes
// a server-side bound of the wait (PostgreSQL: lock_timeout; MariaDB: a
// statement-scoped innodb_lock_wait_timeout, rounded up to whole seconds; MySQL 8 and
// later: MAX_EXECUTION_TIME of a SELECT, which then costs a second statement to draw
// the token; with a token the SELECT is preceded by a try that takes a free lock and
// draws its token in one statement without waiting, skipped for a while after it
// found a lock held: see the package documentation, Cost). When ctx
// ends first, the wait is interrupted without taking a pooled connection if none is
// free: on PostgreSQL with pgx by out-of-band cancel requests; otherwise by KILL QUERY
// (pg_cancel_backend) from a connection that is free at once, or else by closing the
// waiter's connection, in which case the server drops its waiter at the deadline's
// bound or, without a deadline, when it is granted the lock. Either way Lock returns
// within milliseconds of ctx's end (on PostgreSQL, a wait for a table lock that a DDL
// statement holds ends 200 ms after the deadline: the server-side bound is set only
// once the statement has the table), with an error matching both
// sqllock.ErrNotAcquired and ctx.Err(), and no lock is held, even if the database
// granted it at that instant. Deadlocks, serialization failures and server lock wait
// timeouts are retried. sqllock.WithOwner and sqllock.WithLeaseTTL are not supported: the
// lock lives as long as its transaction.
func (l *Locker) Lock(ctx context.Context, name string, opts ...sqllock.AcquireOption) (*Lease, error) {
	return lease.Observed(ctx, l.cfg.Label("forupdate", l.dialect, name), true, func(ctx context.Context) (*Lease, error) {
		return l.lock(ctx, name, opts)
	}, (*Lease).observed)
}

func (l *Locker) lock(ctx context.Context, name string, opts []sqllock.AcquireOption) (*Lease, error) {
	const op = "acquire"
	if err := l.check(op, name, opts); err != nil {
		return nil, err
	}
	if err := lease.Admit(ctx, l.guard, op, l.dialect, name); err != nil {
		return nil, err
	}
	select {
	case l.waiters <- struct{}{}:
	default:
		// Every waiter slot is taken. Try once without waiting: a free name must not
		// queue behind the waiters of a busy one.
		lease, err := l.tryLock(ctx, name, nil)
		if err == nil || !errors.Is(err, sqllock.ErrNotAcquired) || ctx.Err() != nil {
			return lease, err
		}
		l.queued.Add(1)
		select {
		case l.waiters <- struct{}{}:
			l.queued.Add(-1)
		case <-ctx.Done():
			l.queued.Add(-1)
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
	return lease.Observed(ctx, l.cfg.Label("forupdate", l.dialect, name), false, func(ctx context.Context) (*Lease, error) {
		return l.tryLock(ctx, name, opts)
	}, (*Lease).observed)
}

func (l *Locker) tryLock(ctx context.Context, name string, opts []sqllock.AcquireOption) (*Lease, error) {
	const op = "try-acquire"
	if err := l.check(op, name, opts); err != nil {
		return nil, err
	}
	if err := lease.Admit(ctx, l.guard, op, l.dialect, name); err != nil {
		return nil, err
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
// the order of their keys (an ORDER BY would make InnoDB lock every row it sorts). It
// does not wait for a holder; if every name is held it returns an error matching
// sqllock.ErrNotAcquired. The lease's Name tells which name it holds, and no other
// name of the list is locked by it. Names that were never used are created first
// (one more round trip for each missing row). On MySQL the rows are checked and
// created before the transaction, with one more statement per call, because at
// REPEATABLE READ the locking read would gap-lock every missing key it probes for the
// whole lease, blocking the creation of those names' rows; and the token is drawn by
// a second statement once the row is locked (the REPLACE that draws it replaces a
// row named in advance). On PostgreSQL the locking statement draws it.
func (l *Locker) TryAcquireAny(ctx context.Context, names []string) (*Lease, error) {
	const op = "try-acquire-any"
	if len(names) == 0 {
		return nil, lease.NewError(op, l.dialect, "", sqllock.ErrInvalidName, errors.New("no names"))
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
	if err := lease.Admit(ctx, l.guard, op, l.dialect, ""); err != nil {
		return nil, err
	}
	for attempt := 0; ; attempt++ {
		le, err := l.anyAttempt(ctx, op, keys, names, byKey)
		if err == nil || attempt >= maxTryAttempts || !errors.Is(err, errRetry) {
			if errors.Is(err, errRetry) {
				err = lease.NewError(op, l.dialect, "", sqllock.ErrNotAcquired, errors.Unwrap(err))
			}
			return le, err
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
	cfg, err := sqllock.ApplyAcquireOptions(op, l.dialect, name, opts)
	if err != nil {
		return err
	}
	if cfg.Owner != "" || cfg.TTL != 0 {
		return lease.NewError(op, l.dialect, name, sqllock.ErrInvalidOption, errors.New("forupdate locks support neither WithOwner nor WithTTL"))
	}
	return nil
}

// ended reports whether ctx has ended, waiting for it to end if its deadline has
// passed (an error met at the deadline, such as a dial timeout, may come before ctx's
// timer fires).
func ended(ctx context.Context) bool {
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		<-ctx.Done()
	}
	return ctx.Err() != nil
}

func (l *Locker) notAcquired(op, name string, cause error) error {
	return lease.NewError(op, l.dialect, name, sqllock.ErrNotAcquired, cause)
}

// acquireLoop makes attempts until one holds the lock, the lock is busy (modeTry), ctx
// ends or an error that is not transient occurs. granted is called as soon as the
// row lock is held.
func (l *Locker) acquireLoop(ctx context.Context, op, name string, m mode, granted func()) (*Lease, error) {
	key := namekey.Key(name)
	var conflicts, lostSessions int
	for {
		le, err := l.attempt(ctx, op, name, key, m, granted)
		if err == nil {
			return le, nil
		}
		if ended(ctx) && !errors.Is(err, sqllock.ErrInvalidName) {
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
				return nil, lease.NewError(op, l.dialect, name, nil, cause)
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

// waitTarget identifies the session of an attempt, so that a statement of it that
// waits can be interrupted from outside, and so that the lease can find and end it:
// its id (the backend pid on PostgreSQL, with pgx also the connection for
// out-of-band cancel requests; the connection id on MySQL) and a marker comment put
// in the text of the MySQL statements that may wait.
type waitTarget struct {
	pid    int64 // the session's id: pg_backend_pid(), or CONNECTION_ID() with a token (without, the locking read returns it)
	pgc    *pgconn.PgConn
	marker string
	flavor int32 // MySQL: server flavour, for serverWaitBound
}

func (l *Locker) newTarget(ctx context.Context, conn *sql.Conn) (waitTarget, error) {
	t := waitTarget{marker: newMarker()}
	var err error
	if l.dialect == sqllock.Postgres {
		t.pid, t.pgc, err = pgSession(ctx, conn)
		return t, err
	}
	t.flavor = l.myFlavor(ctx, conn)
	if !l.cfg.noToken {
		// Asked once per pinned session: the locking statement (a REPLACE) cannot
		// return it. Without a token the locking read does (myLockFmt, myAnyFmt).
		t.pid, err = l.pins.SessionID(ctx, conn)
	}
	return t, err
}

// raiseTokens makes the tokens a MySQL session draws larger than every token drawn
// in the server's earlier runs, before the session draws one. A token is an
// AUTO_INCREMENT value drawn in the lock transaction, which nothing makes durable
// before that transaction commits: after a crash InnoDB may hand it out again,
// though its holder may have shown it to a resource already. So every run of the
// server has an epoch, one more than the last one recorded, committed before it is
// used (fence.MySQLRun, which advisory's tokens use too), and sqllock_rowlock's
// AUTO_INCREMENT is raised to epoch << fence.EpochShift by a row of its own
// (myEpochKey, whose token is that value) before a session of the run draws: the
// tokens of a run lie between its epoch's value and the next epoch's. vals are the
// current run's epoch (NULL: none yet) and the epoch the counter was raised to, read
// with the session's id (pin.Pool.OnSession): no round trip, but where the run is
// new.
//
// Group Replication refuses writes to sqllock_runs' MEMORY table (error 3098): there
// the Locker logs once that tokens are not protected across a crash, and draws as
// before. A write that changes nothing finds it out before an epoch is recorded (each
// would use one up for good).
func (l *Locker) raiseTokens(ctx context.Context, conn *sql.Conn, vals []sql.NullInt64) error {
	run, raised := vals[0], vals[1]
	if l.noRuns.Load() || (run.Valid && raised.Valid && raised.Int64 >= run.Int64) {
		return nil
	}
	epoch := run.Int64
	if !run.Valid {
		_, err := conn.ExecContext(ctx, "UPDATE sqllock_runs SET base = base WHERE epoch = 0")
		if err == nil {
			epoch, err = l.myRun.Epoch(ctx, conn)
		}
		if sqlerr.IsCode(err, "3098") {
			if l.noRuns.CompareAndSwap(false, true) {
				l.cfg.Logger.Warn("sqllock/forupdate: the server refuses the MEMORY table sqllock_runs (Group Replication): "+
					"the fencing tokens of a lease held when the server crashes may be handed out again after its restart", "err", err)
			}
			return nil
		}
		if err != nil {
			return err
		}
	}
	return raiseCounter(ctx, conn, epoch, raised.Valid)
}

// raiseCounter raises sqllock_rowlock's AUTO_INCREMENT to epoch << EpochShift, with
// the epoch row, unless it is there already. Sessions that raise it at once (clients
// reconnecting after a restart) go one after the other on the epoch row's lock, and
// only the first writes: a second REPLACE of the same value would check the token's
// unique index for it, lock the next entry there, the first token of the run, and wait
// for that lease to end. exists: the session saw the epoch row (myRaisedEpoch); if
// not, it is inserted at once, and only a session that raced another to it goes on to
// the locked REPLACE.
func raiseCounter(ctx context.Context, conn *sql.Conn, epoch int64, exists bool) error {
	v := strconv.FormatInt(epoch<<fence.EpochShift, 10)
	if !exists {
		_, err := conn.ExecContext(ctx, "INSERT INTO sqllock_rowlock (lock_key, name, token) VALUES ("+myEpochKey+", '', "+v+")")
		if err == nil || !sqlerr.Is(err, sqlerr.Duplicate) {
			return err
		}
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var cur int64
	if err := tx.QueryRowContext(ctx, "SELECT token >> "+strconv.Itoa(fence.EpochShift)+" FROM sqllock_rowlock WHERE lock_key = "+myEpochKey+" FOR UPDATE").Scan(&cur); err != nil {
		return err
	}
	if cur < epoch {
		// REPLACE: an explicit value raises AUTO_INCREMENT (an UPDATE does not on
		// MariaDB).
		if _, err := tx.ExecContext(ctx, "REPLACE INTO sqllock_rowlock (lock_key, name, token) VALUES ("+myEpochKey+", '', "+v+")"); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// boundStart is when a lease's server-enforced bound is known to run from, on the
// client, given that its last statement before the lease was sent at sent and
// answered now: sent, unless the statement waited (for the row lock) long enough to
// matter, and then now, on the assumption that a reply travels faster than the
// safety margin.
func (l *Locker) boundStart(sent time.Time) time.Time {
	if time.Since(sent) > l.cfg.Timing.Interval/4 {
		return time.Now()
	}
	return sent
}

// grant is what a successful locking read returns.
type grant struct {
	sid   int64     // session id
	token int64     // fencing token, 0 WithoutToken
	since time.Time // PostgreSQL: the transaction's start, for the keepalive; MySQL: the grant
	at    time.Time // when the lease's bound starts on the client: see lockRow
}

// attempt makes one acquisition attempt on a pooled connection whose session carries
// the bound.
func (l *Locker) attempt(ctx context.Context, op, name string, key []byte, m mode, granted func()) (lease *Lease, err error) {
	conn, err := l.pins.Get(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		return nil, l.classify(op, name, err)
	}
	keep, discard := false, false
	defer func() {
		if keep {
			return
		}
		if discard {
			l.pins.Discard(conn)
		} else {
			l.pins.Put(conn)
		}
	}()
	target, err := l.newTarget(ctx, conn)
	if err != nil {
		return nil, l.classify(op, name, err)
	}
	for created := false; ; created = true {
		// The transaction outlives ctx: it is the lease. database/sql rolls a
		// transaction back when its context ends, so give it one that does not.
		tx, err := conn.BeginTx(context.WithoutCancel(ctx), l.txOpts)
		if err != nil {
			return nil, l.classify(op, name, err)
		}
		g, dirty, err := l.lockRow(ctx, tx, target, key, m, granted)
		discard = discard || dirty
		if err == nil && !discard {
			keep = true
			return l.newLease(name, key, g, conn, tx, target, g.at), nil
		}
		// Whatever failed, end the whole transaction: on MySQL a lock wait timeout
		// rolls back only the statement, and a missing row may have left a gap lock.
		// Granted at the instant ctx ended: give it back.
		tx.Rollback()
		if discard {
			// Only an interrupted wait breaks the session, and only once ctx ended.
			return nil, l.notAcquired(op, name, context.Cause(ctx))
		}
		if !errors.Is(err, errNoRow) {
			return nil, l.classify(op, name, err)
		}
		if created {
			// Created, yet missing: deleted in between. Try again.
			return nil, retryErr{errors.New("lock row still missing after it was created")}
		}
		dirty, err = l.createRow(ctx, conn, target, key, name, m)
		discard = discard || dirty
		switch {
		case discard:
			return nil, l.notAcquired(op, name, context.Cause(ctx))
		case errors.Is(err, errRowBusy):
			return nil, l.notAcquired(op, name, err)
		case err != nil:
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
	return lease.NewError(op, l.dialect, name, nil, err)
}

// drawnPostgres returns the token that pgDrawFmt drew (drawn); the first time in a
// server run, when the run has no epoch yet and drawn is NULL, it records the epoch
// (fence.Drawn), draws again and stores that token in the row of key.
func (l *Locker) drawnPostgres(ctx context.Context, tx *sql.Tx, drawn sql.NullInt64, key []byte) (int64, error) {
	if drawn.Valid {
		return drawn.Int64, nil
	}
	tok, err := fence.Drawn(ctx, drawn, tx, l.db)
	if err != nil {
		return 0, err
	}
	_, err = tx.ExecContext(ctx, pgSetToken, key, tok)
	return tok, err
}

// pgScan scans a row of one of l's PostgreSQL locking statements (pgStatements):
// the key, since, the token drawn (unless WithoutToken) and, if reset, the value of
// pgResetTimeout.
func (l *Locker) pgScan(row *sql.Row, key *[]byte, since *time.Time, drawn *sql.NullInt64, reset bool) error {
	dest := []any{key, since}
	if !l.cfg.noToken {
		dest = append(dest, drawn)
	}
	if reset {
		var s sql.NullString
		dest = append(dest, &s)
	}
	return row.Scan(dest...)
}

// lockRow takes the row lock of key in tx and, unless WithoutToken, draws the new
// token and stores it in the row, in one statement (on MySQL 8 and later with a ctx
// deadline, up to three: see below). It returns errNoRow if the row does not exist, in
// modeTry a LockTimeout-class error when the row is locked (in modeWait such an error
// is a server bound that ran out), and ctx's error when ctx ended. dirty reports that the session must be discarded (see watched). granted is
// called as soon as the row lock is held.
func (l *Locker) lockRow(ctx context.Context, tx *sql.Tx, target waitTarget, key []byte, m mode, granted func()) (g grant, dirty bool, err error) {
	var deadline time.Time
	hasDeadline := false
	if m == modeWait {
		if interrupt.TooLate(ctx) {
			return g, false, ctx.Err()
		}
		deadline, hasDeadline = ctx.Deadline()
	}
	g.sid = target.pid
	sent := time.Now()
	if l.dialect == sqllock.Postgres {
		stmt, args, bounded := l.pg.lock, []any{key}, false
		switch {
		case m == modeTry:
			stmt = l.pg.try
		case hasDeadline:
			stmt, bounded = l.pg.lockTimeout, true
			args = append(args, fmt.Sprintf("%dms", time.Until(deadline).Milliseconds()+1))
		}
		var got []byte
		var drawn sql.NullInt64
		if m == modeTry {
			// Statements that do not wait get ctx; the waiting one runs under watched.
			err = l.pgScan(tx.QueryRowContext(ctx, stmt, args...), &got, &g.since, &drawn, bounded)
		} else {
			dirty, err = l.watched(ctx, target, bounded, func(qctx context.Context) error {
				return l.pgScan(tx.QueryRowContext(qctx, stmt, args...), &got, &g.since, &drawn, bounded)
			})
		}
		g.at = l.boundStart(sent)
		if err = l.locked(ctx, err, dirty, granted); err != nil || l.cfg.noToken {
			return g, dirty, err
		}
		g.token, err = l.drawnPostgres(context.WithoutCancel(ctx), tx, drawn, key)
		return g, false, err
	}
	g.since = sent
	draw := !l.cfg.noToken
	stmt := myLocking(draw, target.marker, key, m == modeTry)
	drawAfter := false // the token is drawn by a second statement, once the lock is held
	if hasDeadline {
		if bounded, ok := serverWaitBound(target.flavor, time.Until(deadline), stmt); ok {
			stmt = bounded
		} else if target.flavor == flavorMySQL8 && draw {
			// MySQL 8 and later bound only a SELECT's wait (MAX_EXECUTION_TIME), and
			// only an INSERT or REPLACE draws an AUTO_INCREMENT value: wait in the
			// bounded locking read, then draw, the lock held, with the statement of
			// TryLock (one more statement). A free lock needs no wait: the statement
			// of TryLock is tried first, which takes it and draws in one statement,
			// unless a recent try found the lock held (nowaitFirst); a held lock
			// fails it at once (3572), and the bounded wait follows in the same
			// transaction.
			if l.nowaitFirst() {
				dirty, err = l.watched(ctx, target, false, func(qctx context.Context) error {
					var err error
					g.token, _, err = myRun(qctx, tx, myLocking(true, target.marker, key, true), true)
					return err
				})
				// Only NOWAIT's refusal (3572) falls through to the wait: it rolls back
				// the statement alone. A lock wait timeout (1205: a wait the try could
				// not avoid, for a metadata lock or the insert's own locks) may have
				// rolled the whole transaction back (innodb_rollback_on_timeout): it is
				// returned, and the attempt retried in a new transaction.
				if !sqlerr.IsCode(err, "3572") || dirty {
					g.at = l.boundStart(sent)
					return g, dirty, l.locked(ctx, err, dirty, granted)
				}
				l.skipNowait.Store(skipNowaitAfterBusy)
				if interrupt.TooLate(ctx) {
					return g, false, ctx.Err()
				}
			}
			// The bound of the wait counts from now, after the try.
			stmt, _ = serverWaitBound(target.flavor, time.Until(deadline), myLocking(false, target.marker, key, false))
			draw, drawAfter = false, true
		}
	}
	var sid int64
	if m == modeTry {
		g.token, sid, err = myRun(ctx, tx, stmt, draw)
	} else {
		dirty, err = l.watched(ctx, target, false, func(qctx context.Context) error {
			var err error
			g.token, sid, err = myRun(qctx, tx, stmt, draw)
			return err
		})
	}
	if sid != 0 {
		g.sid = sid
	}
	g.at = l.boundStart(sent)
	if err = l.locked(ctx, err, dirty, granted); err != nil || !drawAfter {
		return g, dirty, err
	}
	g.at = time.Now()
	g.token, _, err = myRun(context.WithoutCancel(ctx), tx, myLocking(true, target.marker, key, true), true)
	return g, false, err
}

// myRun runs stmt, a statement of myLocking, in tx: with draw (myDrawFmt) it returns
// the token drawn, without, the session's id (myLockFmt); either way sql.ErrNoRows
// if the key has no row.
func myRun(ctx context.Context, tx *sql.Tx, stmt string, draw bool) (token, sid int64, err error) {
	if !draw {
		return 0, sid, tx.QueryRowContext(ctx, stmt).Scan(&sid)
	}
	res, err := tx.ExecContext(ctx, stmt)
	if sqlerr.IsCode(err, "1048") {
		return 0, 0, sql.ErrNoRows // the copy's name is NULL: no row
	}
	if err != nil {
		return 0, 0, err
	}
	token, err = res.LastInsertId()
	return token, 0, err
}

// locked maps the outcome of a locking statement: errNoRow, the statement's error,
// or, if the lock was granted, ctx's error if ctx ended (the caller gives the lock
// back).
func (l *Locker) locked(ctx context.Context, err error, dirty bool, granted func()) error {
	if errors.Is(err, sql.ErrNoRows) {
		return errNoRow
	}
	if err != nil {
		return err
	}
	granted()
	if err := ctx.Err(); err != nil {
		return err
	}
	if dirty {
		return errors.New("session discarded")
	}
	return nil
}

// errRowBusy: a MySQL INSERT creating a lock row waited for a row lock, so the row
// was created (or its key range locked) and is held by another transaction.
var errRowBusy = errors.New("lock row is being created or held by another transaction")

// createRow creates the row of key in autocommit on conn. On MySQL an INSERT that
// meets an existing row waits for that row's lock (InnoDB's duplicate check takes a
// shared lock); the statement is then interrupted when ctx ends, and in modeTry after
// tryCreateWait, returning errRowBusy. dirty is as for watched.
func (l *Locker) createRow(ctx context.Context, conn *sql.Conn, target waitTarget, key []byte, name string, m mode) (dirty bool, err error) {
	if l.dialect == sqllock.Postgres {
		_, err := conn.ExecContext(ctx, pgCreate, key, []byte(name))
		return false, err
	}
	wctx := ctx
	if m == modeTry {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, tryCreateWait)
		defer cancel()
	}
	stmt := fmt.Sprintf(myCreateFmt, target.marker)
	if deadline, ok := wctx.Deadline(); ok {
		stmt, _ = serverWaitBound(target.flavor, time.Until(deadline), stmt)
	}
	dirty, err = l.watched(wctx, target, false, func(qctx context.Context) error {
		_, err := conn.ExecContext(qctx, stmt, key, []byte(name))
		if sqlerr.Is(err, sqlerr.Duplicate) {
			return nil
		}
		return err
	})
	if err != nil && wctx.Err() != nil && ctx.Err() == nil {
		return dirty, errRowBusy
	}
	return dirty, err
}

// tryCreateWait bounds how long TryLock waits for an INSERT on MySQL that met a
// row created and locked by another client in the meantime.
const tryCreateWait = 500 * time.Millisecond

// watched runs stmt, a statement that may wait for a lock on target's session, and
// interrupts the wait on the server when ctx ends first (see internal/interrupt);
// serverBound tells that the statement has a lock_timeout of its own ending at
// ctx's deadline. dirty reports that the session must be discarded.
func (l *Locker) watched(ctx context.Context, target waitTarget, serverBound bool, stmt func(qctx context.Context) error) (dirty bool, err error) {
	l.inDB.Add(1)
	defer l.inDB.Add(-1)
	return interrupt.Interrupter{DB: l.db, Logger: l.cfg.Logger}.Run(ctx, interrupt.Target{
		PgConn: target.pgc,
		Kill: func(ctx context.Context, conn *sql.Conn) error {
			// Not found: the statement has not started waiting yet, or has returned.
			_, err := l.cancelOn(ctx, conn, target.pid, target.marker)
			return err
		},
		Label: target.marker,
	}, serverBound, stmt)
}

// anyAttempt makes one TryAcquireAny attempt.
func (l *Locker) anyAttempt(ctx context.Context, op string, keys [][]byte, names []string, byKey map[string]string) (*Lease, error) {
	conn, err := l.pins.Get(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, l.notAcquired(op, "", ctx.Err())
		}
		return nil, lease.NewError(op, l.dialect, "", nil, err)
	}
	keep, discard := false, false
	defer func() {
		if keep {
			return
		}
		if discard {
			l.pins.Discard(conn)
		} else {
			l.pins.Put(conn)
		}
	}()
	fail := func(err error) (*Lease, error) {
		if ended(ctx) {
			return nil, l.notAcquired(op, "", ctx.Err())
		}
		return nil, l.classify(op, "", err)
	}
	target, err := l.newTarget(ctx, conn)
	if err != nil {
		return fail(err)
	}
	if l.dialect == sqllock.MySQL {
		// At REPEATABLE READ the locking read below would gap-lock the key of every
		// missing row it probes, for the whole lease: create them first.
		keys, discard, err = l.ensureRows(ctx, conn, target, keys, names)
		if discard && ctx.Err() == nil {
			return nil, retryErr{errors.New("session discarded while creating lock rows")}
		}
		if err != nil || discard {
			return fail(err)
		}
		if len(keys) == 0 {
			return nil, l.notAcquired(op, "", errors.New("every name is held"))
		}
	}
	for created := false; ; created = true {
		tx, err := conn.BeginTx(context.WithoutCancel(ctx), l.txOpts)
		if err != nil {
			return fail(err)
		}
		var key []byte
		var g grant
		g.sid = target.pid
		g.at, g.since = time.Now(), time.Now()
		if l.dialect == sqllock.Postgres {
			var drawn sql.NullInt64
			err = l.pgScan(tx.QueryRowContext(ctx, l.pg.any, keys), &key, &g.since, &drawn, false)
			if err == nil && !l.cfg.noToken {
				g.token, err = l.drawnPostgres(ctx, tx, drawn, key)
			}
		} else {
			q := fmt.Sprintf(myAnyFmt, placeholders(len(keys)))
			err = tx.QueryRowContext(ctx, q, anyArgs(keys, 1)...).Scan(&key, &g.sid)
			if err == nil && !l.cfg.noToken {
				// The lock is held: the statement of TryLock draws the token without
				// waiting. (It replaces a row named in advance: it cannot pick one.)
				g.token, _, err = myRun(ctx, tx, myLocking(true, target.marker, key, true), true)
			}
		}
		if err == nil && ctx.Err() == nil {
			keep = true
			return l.newLease(byKey[string(key)], key, g, conn, tx, target, g.at), nil
		}
		tx.Rollback()
		if !errors.Is(err, sql.ErrNoRows) {
			if err == nil {
				err = ctx.Err()
			}
			return fail(err)
		}
		if l.dialect == sqllock.MySQL || created {
			return nil, l.notAcquired(op, "", errors.New("every name is held"))
		}
		// PostgreSQL: nothing free; every row is locked, or some rows do not exist yet
		// (a missing row takes no lock there).
		missing, err := missingRows(ctx, conn, l.dialect, keys)
		if err != nil {
			return fail(err)
		}
		if len(missing) == 0 {
			return nil, l.notAcquired(op, "", errors.New("every name is held"))
		}
		for _, i := range missing {
			if _, err := l.createRow(ctx, conn, target, keys[i], names[i], modeTry); err != nil {
				return fail(err)
			}
		}
	}
}

// ensureRows creates, in autocommit on conn, the missing rows of keys (names[i] is
// the name of keys[i]) and returns the keys that have a row, leaving out those whose
// INSERT met a row lock (created and held by another client: busy).
func (l *Locker) ensureRows(ctx context.Context, conn *sql.Conn, target waitTarget, keys [][]byte, names []string) (existing [][]byte, dirty bool, err error) {
	missing, err := missingRows(ctx, conn, l.dialect, keys)
	if err != nil || len(missing) == 0 {
		return keys, false, err
	}
	busy := make(map[int]bool, len(missing))
	for _, i := range missing {
		dirty, err := l.createRow(ctx, conn, target, keys[i], names[i], modeTry)
		if dirty {
			return nil, true, err
		}
		if errors.Is(err, errRowBusy) {
			busy[i] = true
			continue
		}
		if err != nil {
			return nil, false, err
		}
	}
	for i, k := range keys {
		if !busy[i] {
			existing = append(existing, k)
		}
	}
	return existing, false, nil
}
