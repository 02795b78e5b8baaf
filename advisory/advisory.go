package advisory

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/deploy"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/pin"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

const (
	// DefaultTTL is the server-enforced bound of a held lock's session: a session that
	// sends no statement for this long (a holder cut off by the network, frozen, or
	// whose host died) is ended by the server, which frees the lock. The holder's
	// keep-alive runs a statement on it every DefaultKeepalive, and the holder gives
	// the lease up on its own clock TTL/5 before the bound runs out.
	DefaultTTL = 10 * time.Second

	// DefaultKeepalive is how often a held lock's session is checked, which also
	// restarts its idle timer on the server. A session killed from outside is noticed
	// within about one interval.
	DefaultKeepalive = 2 * time.Second

	// DefaultNamespace is mixed into the hash of a name on PostgreSQL. On MySQL the
	// default namespace is the current database instead (GET_LOCK names are
	// server-wide).
	DefaultNamespace = "sqllock"
)

// Option configures a Locker. Options are validated by New.
type Option func(*config) error

type config struct {
	lease.Config
	token     bool
	namespace string
	nsSet     bool
}

// WithTTL sets the server-enforced bound of a held lock's session (DefaultTTL): the
// session's idle timeout on the server (idle_session_timeout and tcp_user_timeout on
// PostgreSQL 14+; wait_timeout and net_write_timeout on MySQL, in whole seconds,
// rounded up), set while the lock is held and put back when it is released. It must
// be at least twice the keep-alive interval.
func WithTTL(d time.Duration) Option { return func(c *config) error { return c.SetTTL(d) } }

// WithKeepalive sets how often the session of a held lock is checked and its idle
// timer restarted (default DefaultKeepalive). A session killed from outside is
// reported within about one interval. Each check is one small statement per held
// lock.
func WithKeepalive(d time.Duration) Option {
	return func(c *config) error { return c.SetInterval(d) }
}

// WithoutToken skips the fencing token: Lease.Token returns 0, and Acquire draws
// nothing (on MySQL a contended acquisition saves a statement, and an uncontended one
// is a bare GET_LOCK; on PostgreSQL the locking statement reads no sequence). Use it
// when the protected resource does not check tokens.
func WithoutToken() Option {
	return func(c *config) error { c.token = false; return nil }
}

// WithLogger sets the logger for lost leases and failed releases (default: none).
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
// acquisition): GET_LOCK is local to one node, so clients on two nodes would both hold the
// lock. The option is your promise that every client of these locks reaches the same
// writer node (one node address, or a proxy that sends all writes to one node and
// fails over only when that node is gone, which ends its sessions and so its locks).
// Fencing tokens then cost a little more: Galera does not replicate the MEMORY table
// that counts them, so every draw also checks the newest epoch recorded (see
// Lease.Token). The same promise accepts a MySQL Group Replication member of a
// multi-primary group or a secondary, which are refused the same way; with tokens,
// no promise makes a group member acceptable (the group refuses writes to the
// MEMORY table): combine it with WithoutToken there.
func WithGaleraSingleWriter() Option {
	return func(c *config) error { return c.SetGaleraSingleWriter() }
}

// WithNamespace sets the namespace mixed into the hash of every name: Lockers with
// different namespaces never exclude each other. The default is DefaultNamespace on
// PostgreSQL and the current database (DATABASE()) on MySQL. Fencing tokens are
// counted per name, whatever the namespace.
func WithNamespace(ns string) Option {
	return func(c *config) error {
		if ns == "" {
			return errors.New("empty namespace")
		}
		c.namespace, c.nsSet = ns, true
		return nil
	}
}

// Locker takes advisory locks on one database. It is safe for concurrent use. Its
// Acquire and TryAcquire return a *Lease.
type Locker struct {
	db      *sql.DB
	dialect sqllock.Dialect
	cfg     config
	shared  bool
	st      *lockerState
	pins    *pin.Pool
	pgSQL   [2][2]pgStatements
	guard   *deploy.Guard
	// MySQL tokens: every draw also checks the epoch when the Locker was promised a
	// Galera node (Galera does not replicate sqllock_runs).
	myRun  fence.MySQLRun
	myDraw string
}

// lockerState is shared by a Locker and its Shared view.
type lockerState struct {
	mu     sync.Mutex
	owners map[holdKey]*ownerEntry

	nsMu sync.Mutex
	ns   string // resolved MySQL namespace, "" until known

	// pooled is the refusal once a session was seen to move between server backends
	// (see pooler.go).
	pooled atomic.Pointer[error]

	contention contention // MySQL: when names were last seen held elsewhere

	// freeing: freeBackend's waits for a pooled backend in use (see pooler.go).
	freeing sync.WaitGroup
}

var _ sqllock.Locker = (*Locker)(nil)

// New returns a Locker of exclusive locks on db, whose server is of dialect d. It
// sends no SQL. Close it when done.
func New(db *sql.DB, d sqllock.Dialect, opts ...Option) (*Locker, error) {
	cfg := config{Config: lease.Config{Timing: lease.Timing{TTL: DefaultTTL, Interval: DefaultKeepalive}}, token: true}
	if err := lease.New("advisory", db, d, &cfg, &cfg.Config, opts); err != nil {
		return nil, err
	}
	if d == sqllock.MySQL && cfg.Timing.TTL < time.Second {
		return nil, lease.NewError("new", d, "", sqllock.ErrInvalidOption, fmt.Errorf("advisory: TTL %v is shorter than MySQL's smallest wait_timeout, 1s", cfg.Timing.TTL))
	}
	if d == sqllock.Postgres && !cfg.nsSet {
		cfg.namespace = DefaultNamespace
	}
	st := &lockerState{owners: make(map[holdKey]*ownerEntry)}
	if cfg.nsSet {
		st.ns = cfg.namespace
	}
	pins := pin.New(db, d, cfg.Timing.TTL, cfg.Logger)
	if d == sqllock.Postgres {
		pins = pin.NewKeeping(db, d, cfg.Timing.TTL, cfg.Logger, "SELECT "+pgReset)
	}
	myRun := fence.MySQLRun{NewestEpoch: cfg.GaleraSingleWriter}
	return &Locker{db: db, dialect: d, cfg: cfg, st: st,
		myRun: myRun, myDraw: myRun.Draw(),
		pins:  pins,
		pgSQL: pgStatementsFor(cfg.Timing.TTL, cfg.token),
		// Tokens on MySQL are drawn from the MEMORY table sqllock_runs.
		guard: cfg.Guard(db, d, "advisory", deploy.Needs{OneNode: true, MemoryTable: cfg.token && d == sqllock.MySQL}),
	}, nil
}

// Close returns the idle sessions the Locker keeps for reuse to the pool, and waits
// (at most 5 s) for the freeing of a lock left behind a transaction-pooling proxy
// (see Poolers and clusters). Held leases stay valid until released. Idempotent.
func (l *Locker) Close() error {
	l.pins.Close()
	l.st.freeing.Wait()
	return nil
}

// Shared returns a view of l that takes shared locks (pg_advisory_lock_shared): any
// number of shared leases of a name are held at once, and none while an exclusive
// lease of it is held. The view shares l's pool and options. MySQL has no shared
// GET_LOCK: there Shared returns an error matching sqllock.ErrInvalidOption.
func (l *Locker) Shared() (*Locker, error) {
	if l.dialect != sqllock.Postgres {
		return nil, lease.NewError("shared", l.dialect, "", sqllock.ErrInvalidOption, errors.New("GET_LOCK has no shared mode"))
	}
	v := *l
	v.shared = true
	return &v, nil
}

// lockID identifies one server lock.
type lockID struct {
	name   string // for display and tokens
	raw    bool   // PostgreSQL bigint key
	k      int64  // raw key, or k1<<32|k2
	myName string // GET_LOCK name
}

func (id lockID) mapKey() string {
	if id.raw {
		return "k" + strconv.FormatInt(id.k, 10)
	}
	return "n" + id.name
}

func (id lockID) pgArgs() []any {
	if id.raw {
		return []any{id.k}
	}
	return []any{int32(id.k >> 32), int32(id.k)}
}

// PostgresKeys returns the two int4 keys of name on PostgreSQL, as they appear in
// pg_locks (classid, objid; objsubid = 2).
func (l *Locker) PostgresKeys(name string) (k1, k2 int32) {
	k := namekey.Int64(l.cfg.namespace, name)
	return int32(k >> 32), int32(k)
}

// MySQLLockName returns the GET_LOCK name of name on MySQL, as IS_USED_LOCK and
// performance_schema.metadata_locks show it. It may read DATABASE() once.
func (l *Locker) MySQLLockName(ctx context.Context, name string) (string, error) {
	ns, err := l.mysqlNamespace(ctx, l.db)
	if err != nil {
		return "", err
	}
	return mysqlLockName(ns, name), nil
}

func mysqlLockName(ns, name string) string { return "sqllock:" + namekey.Hex(ns, name, 56) }

type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (l *Locker) mysqlNamespace(ctx context.Context, q queryer) (string, error) {
	l.st.nsMu.Lock()
	defer l.st.nsMu.Unlock()
	if l.st.ns != "" {
		return l.st.ns, nil
	}
	var db sql.NullString
	if err := q.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&db); err != nil {
		return "", err
	}
	if !db.Valid || db.String == "" {
		return "", errors.New("no current database: set one in the DSN or use WithNamespace")
	}
	l.st.ns = db.String
	return l.st.ns, nil
}

func (l *Locker) nameID(name string) lockID {
	id := lockID{name: name}
	if l.dialect == sqllock.Postgres {
		id.k = namekey.Int64(l.cfg.namespace, name)
	}
	return id
}

// Acquire waits until the lock name is held or ctx ends, and returns a *Lease. See
// sqllock.Locker. Acquire accepts sqllock.WithOwner (reentrant holds of one owner key
// on this Locker) and rejects sqllock.WithLeaseTTL (a session lock has no lease time).
func (l *Locker) Acquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return l.acquireName(ctx, "acquire", name, true, opts)
}

// TryAcquire makes one attempt to take the lock name, and returns an error matching
// sqllock.ErrNotAcquired at once if it is held by another session (including another
// Lease of this Locker, unless both use the same sqllock.WithOwner key).
func (l *Locker) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return l.acquireName(ctx, "try-acquire", name, false, opts)
}

// AcquireKey is Acquire on a raw PostgreSQL bigint advisory key: the lock that
// pg_advisory_lock(key) takes, shared with any other code using that key. The
// lease's Name is "pg_advisory_lock(<key>)", which also names its fencing counter.
// On MySQL it returns an error matching sqllock.ErrInvalidOption.
func (l *Locker) AcquireKey(ctx context.Context, key int64, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return l.acquireKey(ctx, "acquire", key, true, opts)
}

// TryAcquireKey is TryAcquire on a raw PostgreSQL bigint advisory key (see AcquireKey).
func (l *Locker) TryAcquireKey(ctx context.Context, key int64, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return l.acquireKey(ctx, "try-acquire", key, false, opts)
}

func (l *Locker) acquireName(ctx context.Context, op, name string, wait bool, opts []sqllock.AcquireOption) (sqllock.Lease, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return nil, err
	}
	return l.acquire(ctx, op, l.nameID(name), wait, opts)
}

func (l *Locker) acquireKey(ctx context.Context, op string, key int64, wait bool, opts []sqllock.AcquireOption) (sqllock.Lease, error) {
	if l.dialect != sqllock.Postgres {
		return nil, lease.NewError(op, l.dialect, "", sqllock.ErrInvalidOption, errors.New("raw int64 keys exist on PostgreSQL only"))
	}
	id := lockID{name: "pg_advisory_lock(" + strconv.FormatInt(key, 10) + ")", raw: true, k: key}
	return l.acquire(ctx, op, id, wait, opts)
}

// admit is lease.Admit, and a refusal once the Locker saw its sessions move between
// server backends (a transaction-pooling proxy).
func (l *Locker) admit(ctx context.Context, op string, id lockID) error {
	if err := l.st.pooled.Load(); err != nil {
		return l.errorf(op, id, nil, *err)
	}
	return lease.Admit(ctx, l.guard, op, l.dialect, id.name)
}

func (l *Locker) errorf(op string, id lockID, kind, err error) error {
	return lease.NewError(op, l.dialect, id.name, kind, err)
}

func (l *Locker) acquire(ctx context.Context, op string, id lockID, wait bool, opts []sqllock.AcquireOption) (sqllock.Lease, error) {
	return lease.Observed(ctx, l.cfg.Label("advisory", l.dialect, id.name), wait, func(ctx context.Context) (sqllock.Lease, error) {
		return l.acquireLease(ctx, op, id, wait, opts)
	}, func(le sqllock.Lease) (*lease.Lease, int64) { return le.(*Lease).observed() })
}

func (l *Locker) acquireLease(ctx context.Context, op string, id lockID, wait bool, opts []sqllock.AcquireOption) (sqllock.Lease, error) {
	ac, err := sqllock.ApplyAcquireOptions(op, l.dialect, id.name, opts)
	if err != nil {
		return nil, err
	}
	if ac.TTL != 0 {
		return nil, l.errorf(op, id, sqllock.ErrInvalidOption, errors.New("WithTTL: an advisory lock is held while its session lives, not for a TTL"))
	}
	if err := l.admit(ctx, op, id); err != nil {
		return nil, err
	}
	if ac.Owner == "" {
		le, err := l.lock(ctx, op, id, wait)
		if err != nil {
			return nil, err
		}
		return le, nil
	}

	k := holdKey{shared: l.shared, id: id.mapKey(), owner: ac.Owner}
	for {
		l.st.mu.Lock()
		e := l.st.owners[k]
		if e == nil {
			e = &ownerEntry{ready: make(chan struct{})}
			l.st.owners[k] = e
			l.st.mu.Unlock()
			le, err := l.lock(ctx, op, id, wait)
			l.st.mu.Lock()
			if err != nil {
				delete(l.st.owners, k)
			} else {
				e.s = le.s
				le.s.owner, le.s.ownerEntry = k, e
			}
			close(e.ready)
			l.st.mu.Unlock()
			if err != nil {
				return nil, err
			}
			return le, nil
		}
		l.st.mu.Unlock()
		if !wait {
			// The owner's first acquisition is still waiting for the server lock:
			// TryAcquire must not wait with it.
			select {
			case <-e.ready:
			default:
				return nil, l.errorf(op, id, sqllock.ErrNotAcquired, errors.New("the owner's first acquisition is still waiting"))
			}
		}
		select {
		case <-e.ready:
		case <-ctx.Done():
			return nil, l.errorf(op, id, sqllock.ErrNotAcquired, ctx.Err())
		}
		if e.s != nil {
			if lease := e.s.addHold(); lease != nil {
				return lease, nil
			}
		}
		// The owner's session ended meanwhile: wait for its entry to go, and retry.
		l.st.mu.Lock()
		if l.st.owners[k] == e && e.s != nil && e.s.isEnded() {
			delete(l.st.owners, k)
		}
		l.st.mu.Unlock()
	}
}

type holdKey struct {
	shared bool
	id     string
	owner  string
}

type ownerEntry struct {
	ready chan struct{} // closed once s is set or the acquisition failed
	s     *session
}

// lock pins a connection whose session carries the bound, takes the server lock on
// it and draws the token.
func (l *Locker) lock(ctx context.Context, op string, id lockID, wait bool) (*Lease, error) {
	conn, sid, err := l.pins.GetSession(ctx)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, l.errorf(op, id, sqllock.ErrNotAcquired, cerr)
		}
		return nil, l.errorf(op, id, nil, err)
	}
	var (
		tok   int64
		ok    bool
		dirty bool // the session may hold the lock in an unknown state: discard it
	)
	// granted is when the last statement on the session before the lease starts was
	// sent: the server's idle timer (the bound) restarts after it.
	granted := time.Now()
	if l.dialect == sqllock.Postgres {
		keptSid := sid
		sid, tok, ok, dirty, err = l.pgLock(ctx, conn, keptSid, id, wait)
		if err != nil && l.st.pooled.Load() == nil && !sqlerr.Is(err, sqlerr.SessionLost) {
			// A wait cancelled as the lock was granted fails, and the session keeps
			// the lock. Discarding the session frees it, but not behind an undetected
			// transaction-pooling proxy: unlock it first where the backend is known
			// (its row came back before the error, or the session was kept).
			if target := cmp.Or(sid, keptSid); target != 0 {
				l.unlockOn(ctx, conn, id, target)
			}
		}
	} else {
		if id.myName == "" {
			var ns string
			ns, err = l.mysqlNamespace(ctx, conn)
			if err != nil {
				dirty = true
			}
			id.myName = mysqlLockName(ns, id.name)
		}
		if err == nil {
			sid, tok, granted, ok, dirty, err = l.myLock(ctx, conn, sid, id, wait)
		}
	}
	if err == nil && ok && ctx.Err() != nil {
		// Granted as ctx ended: give it up with the session. On PostgreSQL it is
		// unlocked first: behind an undetected transaction-pooling proxy, closing
		// the client connection would leave it on the backend.
		if l.dialect == sqllock.Postgres {
			l.unlockOn(ctx, conn, id, sid)
		}
		dirty = true
	}
	if err != nil || !ok || dirty {
		if dirty || err != nil {
			l.pins.Discard(conn)
		} else {
			l.pins.PutSession(conn, sid)
		}
		if cerr := ctx.Err(); cerr != nil {
			return nil, l.errorf(op, id, sqllock.ErrNotAcquired, cerr)
		}
		if err != nil {
			if sqlerr.Transient(err) || sqlerr.Is(err, sqlerr.Canceled) {
				return nil, l.errorf(op, id, sqllock.ErrNotAcquired, err)
			}
			return nil, l.errorf(op, id, nil, err)
		}
		return nil, l.errorf(op, id, sqllock.ErrNotAcquired, nil)
	}
	if time.Since(granted) > l.cfg.Timing.Interval/4 {
		// The lock statement waited: the lease starts from a statement sent now, not
		// from the start of the wait.
		granted = time.Now()
		// Not cancelled by ctx: an interrupted statement may break the connection,
		// and the lock is given back on it below.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lease.GiveBackTimeout)
		var err error
		if l.dialect == sqllock.Postgres {
			var ranOn int64
			err = pgRow(sctx, conn, "SELECT pg_backend_pid()", nil, &ranOn)
			if err == nil {
				if refusal := l.leftBehind(ctx, sid, ranOn, "the statement after the wait for the lock"); refusal != nil {
					cancel()
					l.pins.Discard(conn)
					return nil, l.errorf(op, id, nil, refusal)
				}
			}
		} else {
			err = conn.QueryRowContext(sctx, "SELECT 1").Scan(new(int))
		}
		cancel()
		if err == nil && ctx.Err() != nil {
			if l.dialect == sqllock.Postgres {
				l.unlockOn(ctx, conn, id, sid) // see the grant as ctx ended, above
			}
			l.pins.Discard(conn)
			return nil, l.errorf(op, id, sqllock.ErrNotAcquired, ctx.Err())
		}
		if err != nil {
			l.pins.Discard(conn)
			if cerr := ctx.Err(); cerr != nil {
				return nil, l.errorf(op, id, sqllock.ErrNotAcquired, cerr)
			}
			return nil, l.errorf(op, id, nil, err)
		}
	}
	return l.startSession(conn, id, sid, tok, granted), nil
}
