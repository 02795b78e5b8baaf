// Package pin hands out the pinned connections of the session strategies (advisory,
// forupdate) with a server-enforced bound on their session: a session that stays idle
// (no statement from its client) for longer than the bound is ended by the server,
// which frees every lock it held. A holder cut off from the server therefore loses
// its lock on the server within the bound, not when TCP gives up hours later.
//
// On MySQL the bound is the session's wait_timeout (and net_write_timeout, for a
// server blocked sending to a vanished client), in whole seconds, set with one SET
// that also saves the previous values in user variables, and put back before the
// connection returns to the application's pool. Since those two statements would
// double the cost of an uncontended lock, a Pool keeps configured connections for a
// short while (KeepIdle) and reuses them: under load, a lock costs what the bare
// statements cost. It never keeps one while the application's pool is short of
// connections.
//
// On PostgreSQL the strategies set the bound inside their own locking statements
// (set_config of idle_session_timeout or idle_in_transaction_session_timeout, and
// tcp_user_timeout), so the Pool only hands out and takes back connections. A Pool
// made by NewKeeping also keeps sessions whose strategy left its settings on them,
// but only for a Pool that is busy (two sessions taken within KeepIdle), so that a
// strategy can leave out the statements that set and put back the bound on the
// sessions it reuses at once: before its unlock statement the strategy asks Reserve
// whether the session will be kept, and puts the settings back in that statement
// itself if not. A Pool taken from less often hands out and takes back as New's
// does, and nothing runs beside its statements; the last kept session of a burst
// gets its settings put back by a statement of its own when it returns to the
// application's pool.
//
// A Pool also remembers the server's id of each session it hands out or keeps, once
// known (SessionID asks the server the first time; PutSession records one its user
// read anyway), so that a strategy whose locking statement cannot return it (a MySQL
// REPLACE, an INSERT ... SELECT) asks once per session, not once per lock.
//
// On MySQL a Pool also keeps the statements a strategy prepares on a session it
// hands out again (Stmt): a prepared statement skips the server's parsing, about a
// tenth of an uncontended lock's cost, but costs a round trip to prepare, which only
// a reused session earns back. They are closed before the session returns to the
// application's pool; a discarded session's connection is closed, and the server
// frees them with the session.
package pin

import (
	"context"
	"database/sql"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/direct"
	"github.com/sqllock/sqllock/internal/interrupt"
)

// MaxIdle is how many configured connections a Pool keeps at most.
const MaxIdle = 4

// Pool hands out connections of db whose session carries the bound. Safe for
// concurrent use.
type Pool struct {
	db       *sql.DB
	dialect  sqllock.Dialect
	setup    string // MySQL: sets the bound, saving the previous values
	reset    string // MySQL: puts the previous values back
	keepIdle time.Duration
	log      *slog.Logger
	// reserve: the Pool keeps sessions reserved with Reserve (NewKeeping).
	reserve bool
	// onCols and onSession: see OnSession.
	onCols    []string
	onSession func(ctx context.Context, conn *sql.Conn, vals []sql.NullInt64) error

	mu       sync.Mutex
	idle     []idleConn
	sess     map[*sql.Conn]*session // what the Pool knows of connections handed out or kept
	reserved int                    // Reserve calls not yet followed by PutKept or Unreserve
	// The last two times a session was taken: a Pool is busy when they are close.
	lastGet, prevGet time.Time
	timer            *time.Timer
	closed           bool
	sweeps           sync.WaitGroup
}

// session is what a Pool remembers of one connection's session.
type session struct {
	id     int64 // the server's id, or 0 if not known
	reused bool  // handed out again after it was kept
	noPrep bool  // a prepare failed on it: its statements run as text
	stmts  map[string]*direct.Stmt
}

type idleConn struct {
	conn  *sql.Conn
	since time.Time
}

// Seconds returns the bound in whole seconds as MySQL takes it: ttl rounded up, at
// least 1.
func Seconds(ttl time.Duration) int64 {
	return max(int64((ttl+time.Second-1)/time.Second), 1)
}

// Millis returns the bound in milliseconds as PostgreSQL takes it: ttl rounded up.
func Millis(ttl time.Duration) string {
	return strconv.FormatInt(max(int64((ttl+time.Millisecond-1)/time.Millisecond), 1), 10)
}

// New returns a Pool of db for sessions bounded by ttl.
func New(db *sql.DB, d sqllock.Dialect, ttl time.Duration, log *slog.Logger) *Pool {
	p := &Pool{db: db, dialect: d, log: log, keepIdle: min(ttl/4, 2*time.Second)}
	if d == sqllock.MySQL {
		n := strconv.FormatInt(Seconds(ttl), 10)
		p.setup = "SET @sqllock_wait_timeout = @@session.wait_timeout, @sqllock_net_write_timeout = @@session.net_write_timeout, " +
			"SESSION wait_timeout = " + n + ", SESSION net_write_timeout = " + n
		p.reset = "SET SESSION wait_timeout = @sqllock_wait_timeout, SESSION net_write_timeout = @sqllock_net_write_timeout"
	}
	return p
}

// NewKeeping returns a Pool of db whose sessions the strategy configures in its own
// statements, and which keeps sessions for reuse with their settings left on them
// (Reserve, PutKept): reset is the statement that puts the settings back before a
// kept session returns to the application's pool.
func NewKeeping(db *sql.DB, d sqllock.Dialect, ttl time.Duration, log *slog.Logger, reset string) *Pool {
	p := New(db, d, ttl, log)
	p.reset, p.reserve = reset, true
	return p
}

// Get returns a connection whose session carries the bound: a kept one, or a new one
// from the pool, configured.
func (p *Pool) Get(ctx context.Context) (*sql.Conn, error) {
	conn, _, err := p.GetSession(ctx)
	return conn, err
}

// GetSession is Get, and also returns the session's id if the Pool knows it (see
// SessionID), or 0.
func (p *Pool) GetSession(ctx context.Context) (*sql.Conn, int64, error) {
	p.mu.Lock()
	p.prevGet, p.lastGet = p.lastGet, time.Now()
	if n := len(p.idle); n > 0 {
		c := p.idle[n-1] // the most recently used: its session is the warmest
		p.idle = p.idle[:n-1]
		se := p.sessionLocked(c.conn)
		se.reused = true
		sid := se.id
		p.mu.Unlock()
		return c.conn, sid, nil
	}
	p.mu.Unlock()
	conn, err := p.db.Conn(ctx)
	if err != nil {
		return nil, 0, err
	}
	if p.setup != "" {
		if _, err := conn.ExecContext(ctx, p.setup); err != nil {
			interrupt.Release(conn, true)
			return nil, 0, err
		}
	}
	return conn, 0, nil
}

// SessionID returns the server's id of conn's session (CONNECTION_ID() on MySQL,
// pg_backend_pid() on PostgreSQL), conn being a connection of p's. It asks the
// server only the first time for each session: the answer is kept as long as p
// keeps the connection (Put may keep it for reuse), and forgotten when the
// connection returns to the application's pool or is discarded.
func (p *Pool) SessionID(ctx context.Context, conn *sql.Conn) (int64, error) {
	p.mu.Lock()
	var id int64
	if se := p.sess[conn]; se != nil {
		id = se.id
	}
	p.mu.Unlock()
	if id != 0 {
		return id, nil
	}
	q := "SELECT CONNECTION_ID()"
	if p.dialect == sqllock.Postgres {
		q = "SELECT pg_backend_pid()"
	}
	vals := make([]sql.NullInt64, len(p.onCols))
	dest := []any{&id}
	for i, c := range p.onCols {
		q += ", " + c
		dest = append(dest, &vals[i])
	}
	if err := conn.QueryRowContext(ctx, q).Scan(dest...); err != nil {
		return 0, err
	}
	if p.onSession != nil {
		if err := p.onSession(ctx, conn, vals); err != nil {
			return 0, err
		}
	}
	p.record(conn, id)
	return id, nil
}

// OnSession makes SessionID, when it asks a session's id, also read cols (SQL
// expressions of integer or NULL values) in the same statement and pass their values
// to check, which may run statements on conn. It runs once per session as SessionID
// asks once; an error of check is SessionID's, and the id is not remembered, so that
// the next SessionID of the session asks and checks again. Call before the Pool is
// used.
func (p *Pool) OnSession(cols []string, check func(ctx context.Context, conn *sql.Conn, vals []sql.NullInt64) error) {
	p.onCols, p.onSession = cols, check
}

// record remembers sid as conn's session id (0: nothing to remember).
func (p *Pool) record(conn *sql.Conn, sid int64) {
	p.mu.Lock()
	p.recordLocked(conn, sid)
	p.mu.Unlock()
}

// recordLocked is record with mu held.
func (p *Pool) recordLocked(conn *sql.Conn, sid int64) {
	if sid == 0 {
		return
	}
	p.sessionLocked(conn).id = sid
}

// sessionLocked returns what the Pool remembers of conn, creating it. Call with mu
// held.
func (p *Pool) sessionLocked(conn *sql.Conn) *session {
	se := p.sess[conn]
	if se == nil {
		if p.sess == nil {
			p.sess = make(map[*sql.Conn]*session)
		}
		se = &session{}
		p.sess[conn] = se
	}
	return se
}

// forget drops what the Pool remembers of conn, which leaves it, and returns the
// statements prepared on its session.
func (p *Pool) forget(conn *sql.Conn) map[string]*direct.Stmt {
	p.mu.Lock()
	defer p.mu.Unlock()
	se := p.sess[conn]
	delete(p.sess, conn)
	if se == nil {
		return nil
	}
	return se.stmts
}

// Stmt returns query prepared on the session of conn, a connection of p's that it
// handed out, if p is a MySQL Pool and handed conn out again after keeping it: the
// statement prepared the first time is kept with the session. Otherwise, or if
// preparing fails (the statement then fails as text, with the error to report), it
// returns nil: run query as text. After a failed prepare (max_prepared_stmt_count
// reached, a proxy that refuses them) the session is not asked to prepare again. A
// statement must not be used after conn is given back. It is a driver-level
// statement (direct.Stmt): run it with its Row method on conn.
func (p *Pool) Stmt(ctx context.Context, conn *sql.Conn, query string) *direct.Stmt {
	if p.dialect != sqllock.MySQL {
		return nil
	}
	p.mu.Lock()
	se := p.sess[conn]
	if se == nil || !se.reused || se.noPrep {
		p.mu.Unlock()
		return nil
	}
	st := se.stmts[query]
	p.mu.Unlock()
	if st != nil {
		return st
	}
	st, err := direct.Prepare(ctx, conn, query)
	if err != nil {
		p.mu.Lock()
		se.noPrep = true
		p.mu.Unlock()
		p.log.Debug("sqllock: preparing a statement failed; the session runs text", "err", err)
		return nil
	}
	p.mu.Lock()
	if se.stmts == nil {
		se.stmts = make(map[string]*direct.Stmt)
	}
	se.stmts[query] = st
	p.mu.Unlock()
	return st
}

// Put takes back a connection whose session is healthy and holds no lock: it is kept
// for reuse, or its settings are put back and it returns to the application's pool.
func (p *Pool) Put(conn *sql.Conn) { p.PutSession(conn, 0) }

// PutSession is Put of a connection whose server session id is sid (0: unknown),
// which the Pool remembers while it keeps the connection (see SessionID).
func (p *Pool) PutSession(conn *sql.Conn, sid int64) {
	if p.setup == "" {
		p.release(conn)
		return
	}
	p.mu.Lock()
	p.recordLocked(conn, sid)
	if !p.closed && len(p.idle)+p.reserved < MaxIdle && p.roomy() {
		p.keepLocked(conn)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	p.restore(conn)
}

// Reserve reports whether a session given back now (PutKept) will be kept for reuse
// with the settings its strategy left on it: the Pool was made by NewKeeping, is
// busy and has room. After true the caller must call PutKept or Unreserve once.
func (p *Pool) Reserve() bool {
	if !p.reserve {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || len(p.idle)+p.reserved >= MaxIdle || !p.roomy() ||
		p.prevGet.IsZero() || p.lastGet.Sub(p.prevGet) >= p.keepIdle {
		return false
	}
	p.reserved++
	return true
}

// Unreserve gives up a reservation whose session was not given back (discarded).
func (p *Pool) Unreserve() {
	p.mu.Lock()
	p.reserved--
	p.mu.Unlock()
}

// PutKept gives back, after Reserve, a healthy session that holds no lock and still
// carries its strategy's settings; sid is its session id (see GetSession).
func (p *Pool) PutKept(conn *sql.Conn, sid int64) {
	p.mu.Lock()
	p.recordLocked(conn, sid)
	p.reserved--
	if !p.closed {
		p.keepLocked(conn)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	p.restore(conn)
}

// keepLocked keeps conn for reuse. Call with mu held.
func (p *Pool) keepLocked(conn *sql.Conn) {
	p.idle = append(p.idle, idleConn{conn: conn, since: time.Now()})
	if p.timer == nil {
		p.arm(p.keepIdle)
	}
}

// roomy reports whether the application's pool has room to spare (or no limit), so
// that keeping a connection out of it costs the application nothing.
func (p *Pool) roomy() bool {
	st := p.db.Stats()
	return st.MaxOpenConnections == 0 || st.InUse+1 < st.MaxOpenConnections/2
}

// Discard breaks a connection's session: the server drops every lock it held, and
// the statements prepared on it.
func (p *Pool) Discard(conn *sql.Conn) {
	p.forget(conn)
	interrupt.Release(conn, true)
}

// restore puts the session's settings back and returns conn to the application's
// pool, or discards it if that fails.
func (p *Pool) restore(conn *sql.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.ExecContext(ctx, p.reset); err != nil {
		p.log.Debug("sqllock: resetting a session failed; discarding it", "err", err)
		p.Discard(conn)
		return
	}
	p.release(conn)
}

// release returns conn, whose session is healthy and carries no setting of p's, to
// the application's pool, with the statements p prepared on it closed.
func (p *Pool) release(conn *sql.Conn) {
	for _, st := range p.forget(conn) {
		st.Close(conn)
	}
	conn.Close()
}

// arm schedules a sweep after d. Call with mu held.
func (p *Pool) arm(d time.Duration) {
	p.sweeps.Add(1) // done by the sweep, or by Close if it stops the timer
	p.timer = time.AfterFunc(d, p.sweep)
}

// sweep returns the connections kept longer than keepIdle, and reschedules itself
// while some are left.
func (p *Pool) sweep() {
	defer p.sweeps.Done()
	p.mu.Lock()
	p.timer = nil
	var old []*sql.Conn
	keep := p.idle[:0]
	now := time.Now()
	for _, c := range p.idle {
		if p.closed || now.Sub(c.since) >= p.keepIdle || !p.roomy() {
			old = append(old, c.conn)
		} else {
			keep = append(keep, c)
		}
	}
	p.idle = keep
	if len(keep) > 0 && !p.closed {
		p.arm(max(p.keepIdle-now.Sub(keep[0].since), time.Millisecond))
	}
	p.mu.Unlock()
	for _, c := range old {
		p.restore(c)
	}
}

// Close returns every kept connection to the application's pool. Connections handed
// out stay valid; Put after Close returns them at once.
func (p *Pool) Close() {
	p.mu.Lock()
	p.closed = true
	if p.timer != nil && p.timer.Stop() {
		p.timer = nil
		p.sweeps.Done() // the sweep it stopped will not run
	}
	idle := p.idle
	p.idle = nil
	p.mu.Unlock()
	for _, c := range idle {
		p.restore(c.conn)
	}
	p.sweeps.Wait()
}
