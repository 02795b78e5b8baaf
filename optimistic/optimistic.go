package optimistic

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/prep"
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
	// DefaultAttemptTimeout bounds one statement of an attempt or a renewal.
	DefaultAttemptTimeout = rowlease.DefaultAttemptTimeout
)

// Option configures a Locker. Options are validated by New.
type Option func(*rowlease.Config) error

// WithTTL sets the lease time of the Locker's leases (DefaultTTL): the
// server-enforced bound, on the database clock, after which a holder that stopped
// renewing loses the lock. sqllock.WithLeaseTTL overrides it for one acquisition.
func WithTTL(d time.Duration) Option { return func(c *rowlease.Config) error { return c.SetTTL(d) } }

// WithKeepalive sets how often a lease is renewed (default TTL/3). It must be at most
// half the TTL.
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

// Locker acquires optimistic leases. It is safe for concurrent use. Close it when
// done: it stops the PostgreSQL listener. Leases stay valid after Close until they are
// released.
type Locker struct {
	b *rowlease.Locker

	mu       sync.Mutex
	versions map[string]int64 // key -> version this Locker last released: the next CAS
}

// maxVersions bounds the version cache of a Locker.
const maxVersions = 4096

// New returns a Locker on db, which must have been migrated (migrations.Up). It sends
// no SQL. It returns an error matching sqllock.ErrInvalidOption for an invalid
// dialect or option.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := rowlease.Defaults()
	if err := lease.New("optimistic", db, d, &cfg, &cfg.Config, opts); err != nil {
		return nil, err
	}
	b := rowlease.New("optimistic", db, d, cfg, channel)
	b.EnableLine()
	return &Locker{b: b, versions: map[string]int64{}}, nil
}

// Close stops the shared PostgreSQL listener and wakes the waiters, which go on by
// polling. Held leases are not released. Idempotent.
func (l *Locker) Close() error {
	l.b.Close()
	return nil
}

// Holder returns the current holder of name: the host, pid, version (the token) and
// grant time its row records, and the time left of its lease, both on the database
// clock. It sends one read statement and takes no lock. It returns an error matching
// sqllock.ErrNoHolder when the row is free or expired. See sqllock.HolderInspector
// and sqllock.Leader.
func (l *Locker) Holder(ctx context.Context, name string) (sqllock.Holder, error) {
	return l.b.Holder(ctx, name, l.b.Pick(holderPostgres, holderMySQL))
}

// Acquire waits until the lock name is held, or ctx ends. See sqllock.Locker.
// sqllock.WithOwner makes the acquisition reentrant within this Locker;
// sqllock.WithLeaseTTL overrides the lease time.
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

func (l *Locker) acquire(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	return lease.Observed(ctx, l.b.Cfg.Label("optimistic", l.b.Dialect, name), block, func(ctx context.Context) (*Lease, error) {
		return l.acquireLease(ctx, op, name, opts, block)
	}, (*Lease).observed)
}

func (l *Locker) acquireLease(ctx context.Context, op, name string, opts []sqllock.AcquireOption, block bool) (*Lease, error) {
	ac, tm, err := l.b.Prelude(ctx, op, name, opts)
	if err != nil {
		return nil, err
	}
	a := &attempt{l: l, key: namekey.Key(name), name: name, owner: l.b.Owner('L', ac.Owner), ttl: tm.TTL, reentrant: ac.Owner != "", block: block}
	slot, turn, uncertain, kind, err := wait.Loop{
		Hub: l.b.Hub, Key: string(a.key), Block: block, Queue: !a.reentrant, Poll: l.b.Cfg.Poll, Log: l.b.Cfg.Logger,
		Attempt: func(ctx context.Context) (wait.Result, error) {
			res, err := a.try(ctx)
			if err == nil && res.Acquired {
				a.start, res.Acquired, err = l.b.Fresh(ctx, a.start, a.ttl, func(ctx context.Context) (bool, error) {
					n, err := l.b.Changed(ctx, nil, l.b.Pick(renewPostgres, renewMySQL), renewArgs(l.b.Dialect, a.key, a.version, a.owner, a.ttl)...)
					return n > 0, err
				})
			}
			return res, err
		},
		Line: l.b.Line,
		InLine: func(ctx context.Context, t *wait.Turn, enter bool) (wait.Result, error) {
			var res wait.Result
			var err error
			if enter {
				res, err = a.enter(ctx, t)
			} else {
				res, err = a.tryOn(ctx, t)
			}
			if err == nil && res.Acquired {
				a.start, res.Acquired, err = l.b.Fresh(ctx, a.start, a.ttl, func(ctx context.Context) (bool, error) {
					n, err := l.b.Kept(ctx, t, nil, l.b.Pick(renewPostgres, renewMySQL), renewArgs(l.b.Dialect, a.key, a.version, a.owner, a.ttl)...)
					return n > 0, err
				})
			}
			return res, err
		},
	}.Run(ctx)
	if err != nil {
		if uncertain && !a.reentrant {
			l.forget(ctx, a.key, a.owner)
		}
		return nil, l.b.Errorf(op, name, kind, err)
	}
	le := l.newLease(name, a.key, a.owner, a.version, tm, a.reentrant, a.start, slot, turn)
	if err := lease.Granted(ctx, le.core.Label(), op, le.Release); err != nil {
		return nil, err
	}
	return le, nil
}

// attempt is the state of one acquisition across its attempts.
type attempt struct {
	l         *Locker
	key       []byte
	name      string
	owner     []byte
	ttl       time.Duration
	reentrant bool
	block     bool      // Acquire (it will wait), not TryAcquire
	version   int64     // the granted version (the token)
	start     time.Time // when the statement that set the expiry was sent
}

// try is one attempt: a compare-and-swap with the version this Locker saw last, if
// any (one statement when the name is used again by the same Locker); else, or if
// that fails, read the row (creating it on first use) and compare-and-swap with the
// version read. A live row of the same owner is re-entered (WithOwner) or adopted
// (this acquisition's own, from an attempt whose reply was lost).
func (a *attempt) try(ctx context.Context) (wait.Result, error) {
	actx, cancel := a.l.b.AttemptContext(ctx)
	defer cancel()
	return a.tryWith(actx, poolQuerier{a.l.b.Stmts}, a.block)
}

// querier runs the statements of an attempt: on the pool, through the Locker's
// statement cache, or on one connection.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// poolQuerier runs statements through the statement cache.
type poolQuerier struct{ c *prep.Cache }

func (p poolQuerier) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return p.c.Exec(ctx, query, args...)
}

func (p poolQuerier) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return p.c.QueryRow(ctx, query, args...)
}

// tryWith is try on q. With mark, a lock found held is marked waited for
// (PostgreSQL), so that its release notifies.
func (a *attempt) tryWith(actx context.Context, q querier, mark bool) (wait.Result, error) {
	l := a.l
	if v, ok := l.cachedVersion(a.key); ok && !a.reentrant {
		if ok, err := a.swap(actx, q, v); err != nil || ok {
			return wait.Result{Acquired: ok}, err
		}
	}
	for created := false; ; created = true {
		var (
			v     int64
			owner []byte
			left  int64
		)
		err := q.QueryRowContext(actx, l.b.Pick(readPostgres, readMySQL), a.key).Scan(&v, &owner, &left)
		if errors.Is(err, sql.ErrNoRows) && !created {
			if err := a.create(actx, q); err != nil {
				return wait.Result{}, err
			}
			continue
		}
		if err != nil {
			return wait.Result{}, err
		}
		l.rememberVersion(a.key, v)
		if left > 0 {
			if string(owner) == string(a.owner) {
				ok, err := a.reenter(actx, q)
				return wait.Result{Acquired: ok}, err
			}
			if mark && l.b.Dialect == sqllock.Postgres {
				if _, err := q.ExecContext(actx, markPostgres, a.key); err != nil {
					l.b.Cfg.Logger.Debug("sqllock/optimistic: marking the lock waited for failed; the waiter polls", "err", err)
				}
			}
			return wait.Result{HolderLeft: time.Duration(left) * time.Microsecond}, nil
		}
		ok, err := a.swap(actx, q, v)
		return wait.Result{Acquired: ok}, err
	}
}

func (a *attempt) create(ctx context.Context, q querier) error {
	var err error
	if a.l.b.Dialect == sqllock.Postgres {
		_, err = q.ExecContext(ctx, createPostgres, a.key, []byte(a.name))
	} else {
		_, err = q.ExecContext(ctx, createMySQL, a.key, []byte(a.name), a.key)
	}
	return err
}

// swap is the compare-and-swap from version v. It reports whether it took the lock.
func (a *attempt) swap(ctx context.Context, q querier, v int64) (bool, error) {
	l := a.l
	us := a.ttl.Microseconds()
	start := l.b.Now()
	if l.b.Dialect == sqllock.Postgres {
		var nv int64
		err := q.QueryRowContext(ctx, acquirePostgres, a.key, v, a.owner, us, l.b.Host, l.b.PID).Scan(&nv)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		a.version, a.start = nv, start
		return true, nil
	}
	res, err := q.ExecContext(ctx, acquireMySQL, a.owner, us, l.b.Host, l.b.PID, a.key, a.key, v)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	if err != nil || n == 0 {
		return false, err
	}
	nv, err := res.LastInsertId()
	if err != nil {
		return false, err
	}
	a.version, a.start = nv, start
	return true, nil
}

// reenter adds a hold to the owner's live row (reentrant) or adopts it (this
// acquisition's own). It reports whether the row was the owner's.
func (a *attempt) reenter(ctx context.Context, q querier) (bool, error) {
	l := a.l
	us := a.ttl.Microseconds()
	start := l.b.Now()
	if l.b.Dialect == sqllock.Postgres {
		var v int64
		err := q.QueryRowContext(ctx, reenterPostgres, a.key, a.owner, us, a.reentrant).Scan(&v)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		a.version, a.start = v, start
		return true, nil
	}
	res, err := q.ExecContext(ctx, reenterMySQL, a.reentrant, us, a.key, a.owner)
	if err != nil {
		return false, err
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return false, err
	}
	v, err := res.LastInsertId()
	if err != nil {
		return false, err
	}
	a.version, a.start = v, start
	return true, nil
}

// tryOn is try on a turn's session that holds the line lock already: the same
// statements, on that session.
func (a *attempt) tryOn(ctx context.Context, t *wait.Turn) (wait.Result, error) {
	var res wait.Result
	err := t.Run(ctx, "optimistic attempt", func(qctx context.Context, conn *sql.Conn) error {
		var err error
		res, err = a.tryWith(qctx, conn, false) // in line: a release notifies whoever holds its lock
		return err
	})
	return res, err
}

// enter is one attempt on turn t's session that first enters the key's server-side
// line: one statement that waits for the line lock and then takes the row if it is
// free (acquireLinePostgres, acquireLineMySQL).
func (a *attempt) enter(ctx context.Context, t *wait.Turn) (wait.Result, error) {
	l := a.l
	actx, cancel, lineWait := l.b.Line.EntryContext(ctx, l.b.Cfg.Attempt)
	defer cancel()
	us := a.ttl.Microseconds()
	var res wait.Result
	err := t.Run(actx, "optimistic attempt", func(qctx context.Context, conn *sql.Conn) error {
		start := l.b.Now()
		if l.b.Dialect == sqllock.Postgres {
			var v sql.NullInt64
			var inserted bool
			var waited sql.NullBool
			err := conn.QueryRowContext(qctx, acquireLinePostgres, a.key, []byte(a.name), a.owner, us, l.b.Host, l.b.PID,
				pin.Millis(lineWait), pin.Millis(a.ttl), wait.PgPID(conn)).Scan(&v, &inserted, &waited)
			if sqlerr.Is(err, sqlerr.LockTimeout) {
				return nil // the wait ran out: not entered
			}
			if err != nil {
				return err
			}
			if !waited.Valid {
				l.b.Line.Off("the server session is not the one the client connected to")
				return nil
			}
			res.Entered, res.Waited = true, waited.Bool
			if !v.Valid {
				return nil // held
			}
			if inserted {
				// A row created meanwhile: its version came from a snapshot older
				// than the wait; check the counter again.
				if err := conn.QueryRowContext(qctx, fixVersionPostgres, a.key, a.owner, v.Int64).Scan(&v); err != nil {
					return err
				}
			}
			a.version, a.start, res.Acquired = v.Int64, start, true
			return nil
		}
		q := fmt.Sprintf(acquireLineMySQL, wait.MyEnter(l.b.Line.MyName(namekey.MySQLHex(a.key)), lineWait), namekey.MySQLHex(a.key),
			namekey.MySQLHex(a.owner), us, namekey.MySQLHex([]byte(l.b.Host)), l.b.PID)
		r, err := conn.ExecContext(qctx, q)
		if err != nil {
			return err
		}
		n, err := r.RowsAffected()
		if err != nil {
			return err
		}
		if n == 1 {
			v, err := r.LastInsertId()
			if err != nil {
				return err
			}
			a.version, a.start = v, start
			res.Entered, res.Acquired = true, true
			return nil
		}
		// Not taken: the wait ran out, or the row is held or missing. Whether the
		// session holds the line lock tells the first from the others.
		var mine sql.NullBool
		if err := conn.QueryRowContext(qctx, "SELECT IS_USED_LOCK("+l.b.Line.MyName(namekey.MySQLHex(a.key))+") = CONNECTION_ID()").Scan(&mine); err != nil {
			return err
		}
		res.Entered = mine.Valid && mine.Bool
		return nil
	})
	return res, err
}

func (l *Locker) cachedVersion(key []byte) (int64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	v, ok := l.versions[string(key)]
	return v, ok
}

func (l *Locker) rememberVersion(key []byte, v int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.versions[string(key)]; !ok && len(l.versions) >= maxVersions {
		for k := range l.versions { // drop one at random
			delete(l.versions, k)
			break
		}
	}
	l.versions[string(key)] = v
}

// forget frees the row an attempt of owner may have taken without the caller
// learning of it, so that a caller that gives up leaves nothing held behind. It waits
// at most the attempt timeout (and lease.GiveBackTimeout). Best effort: on MySQL a
// statement abandoned while it waited in the server may still commit after this;
// such a lease, renewed by nobody, expires after its TTL.
func (l *Locker) forget(ctx context.Context, key, owner []byte) {
	var probe func(context.Context) (bool, error)
	if l.b.Dialect == sqllock.MySQL {
		probe = func(ctx context.Context) (bool, error) {
			var one int
			err := l.b.DB.QueryRowContext(ctx, forgetProbeMySQL, key, owner).Scan(&one)
			if errors.Is(err, sql.ErrNoRows) {
				return false, nil
			}
			return err == nil, err
		}
	}
	q := l.b.Pick(forgetPostgres, forgetMySQL)
	wait.Forget(ctx, min(lease.GiveBackTimeout, l.b.Cfg.Attempt), probe, func(ctx context.Context) error {
		_, err := l.b.Stmts.Exec(ctx, q, key, owner)
		return err
	}, l.b.Cfg.Logger)
}

// Sweeper deletes rows of names free for longer than a grace period, for the reaper
// package (it implements reaper.Sweeper).
type Sweeper struct {
	db      *sql.DB
	dialect sqllock.Dialect
	grace   time.Duration
}

// NewSweeper returns the Sweeper of the optimistic table: each batch deletes rows
// free for more than grace by the database clock, after raising their names' counters
// in sqllock_fence to their versions, so that tokens keep increasing when a swept
// name is used again. It locks only the rows it deletes and skips (PostgreSQL) rows
// being acquired.
func NewSweeper(db *sql.DB, d sqllock.Dialect, grace time.Duration) (*Sweeper, error) {
	if db == nil || !d.Valid() || grace < 0 {
		return nil, lease.NewError("new-sweeper", d, "", sqllock.ErrInvalidOption,
			fmt.Errorf("need a *sql.DB, a valid dialect and a grace period >= 0 (got %v)", grace))
	}
	return &Sweeper{db: db, dialect: d, grace: grace}, nil
}

// Name returns "sqllock_optimistic".
func (s *Sweeper) Name() string { return "sqllock_optimistic" }

// SweepBatch deletes at most limit rows free for longer than the grace period,
// oldest first. See reaper.Sweeper.
func (s *Sweeper) SweepBatch(ctx context.Context, limit int) (deleted int, more bool, err error) {
	if limit <= 0 {
		return 0, false, nil
	}
	us := s.grace.Microseconds()
	if s.dialect == sqllock.Postgres {
		var cand, n, f int64
		if err := s.db.QueryRowContext(ctx, sweepPostgres, us, limit).Scan(&cand, &n, &f); err != nil {
			return 0, false, err
		}
		return int(n), cand >= int64(limit), nil
	}
	return rowlease.StashingSweepMySQL(ctx, s.db, "sqllock_optimistic", "version", false, us, limit)
}
