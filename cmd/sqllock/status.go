package main

import (
	"context"
	"database/sql"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/internal/wait"
)

// Lock is one entry of `sqllock status --json`: a held lock (or, for uniqueindex and
// optimistic, an expired row not yet taken over), its holder and its waiters. The
// field names are stable; unknown values are null.
type Lock struct {
	Strategy string  `json:"strategy"` // uniqueindex, optimistic, fairqueue, forupdate, advisory
	Name     *string `json:"name"`     // the lock name, or null when it cannot be told ("unknown name")
	// Key identifies the lock on the server: hex SHA-256 of the name for the row
	// strategies; "pg:K1:K2" (the int4 pair) or "pg:bigint:K" for PostgreSQL advisory
	// locks; the GET_LOCK name (sqllock:<hex>) for MySQL advisory locks.
	Key    string `json:"key"`
	Holder *Party `json:"holder"`
	// Token is the holder's fencing token where the server shows it (lease token,
	// optimistic version, fairqueue ticket); null otherwise.
	Token *int64 `json:"token"`
	// Since is when the lock was acquired (database clock, UTC), where known:
	// acquired_at of a row, the ticket's creation, the transaction's start (forupdate).
	Since *time.Time `json:"since"`
	// ExpiresIn is the time left (seconds, database clock) of a row lease; zero or
	// less: expired. Null for session and transaction locks.
	ExpiresIn *float64 `json:"expires_in"`
	Waiters   []Party  `json:"waiters"` // in queue order where the server tells it
	Note      string   `json:"note"`    // what status could not see about this lock, if anything
}

// Party is a holder or a waiter.
type Party struct {
	Host        *string    `json:"host"`        // the client's host: as the library recorded it, else the address the server sees
	PID         *int64     `json:"pid"`         // the client's process id, where recorded (row strategies; MySQL connection attribute _pid)
	Session     *int64     `json:"session"`     // the server session: PostgreSQL backend pid, MySQL connection id
	Application *string    `json:"application"` // application_name (PostgreSQL), program_name or _client_name (MySQL)
	State       *string    `json:"state"`       // the session's state, as the server reports it
	Ticket      *int64     `json:"ticket"`      // fairqueue: the waiter's ticket
	Since       *time.Time `json:"since"`       // when it started waiting (or drew its ticket), where known
}

type statusOpts struct {
	names     []string // candidate names for advisory keys, from -name
	namespace string   // advisory namespace, from -namespace
}

// snapshot is one reading of every strategy's locks.
type snapshot struct {
	Locks []Lock
	Notes []string // what this server does not let status see
}

func ptr[T any](v T) *T { return &v }

func nullStr(s sql.NullString) *string {
	if !s.Valid || s.String == "" {
		return nil
	}
	return &s.String
}

func nullInt(n sql.NullInt64) *int64 {
	if !n.Valid {
		return nil
	}
	return &n.Int64
}

func microTime(n sql.NullInt64) *time.Time {
	if !n.Valid {
		return nil
	}
	return ptr(time.UnixMicro(n.Int64).UTC())
}

func leftSeconds(n sql.NullInt64) *float64 {
	if !n.Valid {
		return nil
	}
	return ptr(float64(n.Int64) / 1e6)
}

// sqlDialect holds the expressions that differ between the dialects.
type sqlDialect struct {
	d                sqllock.Dialect
	mariaDB          bool
	micros           func(col string) string // a timestamp column as µs since the epoch
	left             func(col string) string // µs from now to a timestamp column
	now              string                  // "now" for comparisons with the tables' times
	processlist      string
	perfSchema       bool // MySQL: performance_schema is on
	metadataLockInfo bool // MariaDB: information_schema.METADATA_LOCK_INFO is installed
}

func newSQLDialect(ctx context.Context, db *sql.DB, d sqllock.Dialect) (*sqlDialect, error) {
	if d == sqllock.Postgres {
		return &sqlDialect{d: d,
			micros: func(c string) string { return "floor(extract(epoch FROM " + c + ") * 1000000)::bigint" },
			left: func(c string) string {
				return "floor(extract(epoch FROM (" + c + " - clock_timestamp())) * 1000000)::bigint"
			},
			now: "clock_timestamp()",
		}, nil
	}
	s := &sqlDialect{d: d,
		micros:      func(c string) string { return "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', " + c + ")" },
		left:        func(c string) string { return "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), " + c + ")" },
		now:         "UTC_TIMESTAMP(6)",
		processlist: "performance_schema.processlist",
	}
	var version string
	var ps sql.NullInt64
	if err := db.QueryRowContext(ctx, "SELECT VERSION(), @@performance_schema").Scan(&version, &ps); err != nil {
		return nil, err
	}
	s.perfSchema = ps.Valid && ps.Int64 == 1
	if strings.Contains(strings.ToLower(version), "mariadb") {
		// MariaDB has no performance_schema.processlist. (MySQL 8 and 9 fail queries on
		// information_schema.PROCESSLIST while a statement that is not valid utf8mb3
		// runs, such as forupdate's with a binary key: use it on MariaDB only.)
		s.mariaDB, s.processlist = true, "information_schema.PROCESSLIST"
		var n int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.TABLES
WHERE TABLE_SCHEMA = 'information_schema' AND TABLE_NAME = 'METADATA_LOCK_INFO'`).Scan(&n); err != nil {
			return nil, err
		}
		s.metadataLockInfo = n > 0
	}
	return s, nil
}

// collect reads the locks of every strategy.
func collect(ctx context.Context, db *sql.DB, d sqllock.Dialect, o statusOpts) (*snapshot, error) {
	s, err := newSQLDialect(ctx, db, d)
	if err != nil {
		return nil, err
	}
	snap := &snapshot{}
	advisory := func(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
		if d == sqllock.Postgres {
			return pgAdvisoryLocks(ctx, db, s, snap, o)
		}
		return myAdvisoryLocks(ctx, db, s, snap, o)
	}
	rowLocks := myRowLocks
	if d == sqllock.Postgres {
		rowLocks = pgRowLocks
	}
	for _, f := range []struct {
		what string
		read func(context.Context, *sql.DB, *sqlDialect, *snapshot) error
	}{
		{"uniqueindex", leaseLocks}, {"optimistic", optimisticLocks}, {"fairqueue", fairqueueLocks},
		{"forupdate", rowLocks}, {"advisory", advisory},
	} {
		if err := f.read(ctx, db, s, snap); err != nil {
			// A view the user may not read hides that strategy only.
			if sqlerr.IsCode(err, "42501") || sqlerr.IsCode(err, "1227") || sqlerr.IsCode(err, "1142") || sqlerr.IsCode(err, "1143") {
				snap.Notes = append(snap.Notes, f.what+": not visible to this user: "+err.Error())
				continue
			}
			return nil, err
		}
	}
	return snap, nil
}

func keyHex(k []byte) string { return hex.EncodeToString(k) }

// add files p as a waiter, or the holder, of the lock of key in snap (made by mk the
// first time; byKey indexes snap.Locks by key). holder reports that p became the
// lock's holder (a later holder record of the same lock is ignored).
func (snap *snapshot) add(byKey map[string]int, key string, mk func() Lock, p Party, waiting bool) (l *Lock, holder bool) {
	i, ok := byKey[key]
	if !ok {
		i = len(snap.Locks)
		byKey[key] = i
		snap.Locks = append(snap.Locks, mk())
	}
	l = &snap.Locks[i]
	switch {
	case waiting:
		l.Waiters = append(l.Waiters, p)
	case l.Holder == nil:
		l.Holder, holder = &p, true
	}
	return l, holder
}

// rowTable describes the lease rows of a row strategy for rowLocks.
type rowTable struct {
	strategy, table string
	token           string // the column that is the fencing token
	waiters         string // a boolean column: someone waits (FALSE if none)
	where           string // which rows are held or expired leases
	waitNote        string // where the waiters are
	expiredNote     string // what an expired row means
}

var (
	// leaseRows: uniqueindex (expired rows too: they stay until taken over or swept;
	// released rows on MySQL, which keeps them with no hold, are not leases).
	leaseRows = rowTable{strategy: "uniqueindex", table: "sqllock_lease", token: "token", waiters: "waiters", where: "holds > 0",
		waitNote:    "waiters outside the server-side line wait in their own processes and are not listed",
		expiredNote: "expired: free, the row stays until it is taken over or swept"}
	// optimisticRows: the rows of sqllock_optimistic that have an owner.
	optimisticRows = rowTable{strategy: "optimistic", table: "sqllock_optimistic", token: "version", waiters: "FALSE", where: "holds > 0",
		waitNote:    "waiters outside the server-side line wait in their own processes and are not listed",
		expiredNote: "expired: free, the next compare-and-swap takes it"}
)

func leaseLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
	return rowLocks(ctx, db, s, snap, leaseRows)
}

func optimisticLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
	return rowLocks(ctx, db, s, snap, optimisticRows)
}

// rowLocks reads the lease rows of t: holder, token, since, time left on the
// database clock.
func rowLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot, t rowTable) error {
	waiters := t.waiters
	if s.d == sqllock.MySQL {
		waiters = "FALSE" // MySQL rows have no waiters mark
	}
	rows, err := db.QueryContext(ctx, "SELECT lock_key, name, host, pid, holds, "+t.token+", "+s.micros("acquired_at")+", "+
		s.left("expires_at")+", "+waiters+" FROM "+t.table+" WHERE "+t.where+" ORDER BY name")
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			key, name     []byte
			host          string
			pid, token    int64
			holds         int
			since, left   sql.NullInt64
			flaggedWaiter bool
		)
		if err := rows.Scan(&key, &name, &host, &pid, &holds, &token, &since, &left, &flaggedWaiter); err != nil {
			return err
		}
		l := Lock{Strategy: t.strategy, Name: ptr(string(name)), Key: keyHex(key),
			Holder: &Party{Host: ptr(host), PID: ptr(pid)}, Token: ptr(token),
			Since: microTime(since), ExpiresIn: leftSeconds(left), Waiters: []Party{}, Note: t.waitNote}
		if flaggedWaiter {
			l.Note = "someone waits (the row's waiters flag); " + t.waitNote
		}
		if holds > 1 {
			l.Note = fmt.Sprintf("held %d times (reentrant); ", holds) + l.Note
		}
		if left.Valid && left.Int64 <= 0 {
			l.Note = t.expiredNote
		}
		snap.Locks = append(snap.Locks, l)
	}
	return rows.Err()
}

// fairqueueLocks reads the live tickets: the lowest of a name holds it, the others
// wait in ticket order.
func fairqueueLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
	rows, err := db.QueryContext(ctx, "SELECT t.lock_key, q.name, t.ticket, t.host, t.pid, "+s.micros("t.created_at")+", "+
		s.left("t.expires_at")+` FROM sqllock_ticket t LEFT JOIN sqllock_queue q ON q.lock_key = t.lock_key
WHERE t.expires_at > `+s.now+" ORDER BY t.lock_key, t.ticket")
	if err != nil {
		return err
	}
	defer rows.Close()
	var cur *Lock
	for rows.Next() {
		var (
			key, name     []byte
			ticket, pid   int64
			host          string
			created, left sql.NullInt64
		)
		if err := rows.Scan(&key, &name, &ticket, &host, &pid, &created, &left); err != nil {
			return err
		}
		p := Party{Host: ptr(host), PID: ptr(pid), Ticket: ptr(ticket), Since: microTime(created)}
		if cur != nil && cur.Key == keyHex(key) {
			cur.Waiters = append(cur.Waiters, p)
			continue
		}
		if cur != nil {
			snap.Locks = append(snap.Locks, *cur)
		}
		p.Ticket = nil
		cur = &Lock{Strategy: "fairqueue", Key: keyHex(key), Holder: &p, Token: ptr(ticket),
			Since: microTime(created), ExpiresIn: leftSeconds(left), Waiters: []Party{},
			Note: "a semaphore's first n tickets all hold (n is not stored): the waiters list them after the first"}
		if name != nil {
			cur.Name = ptr(string(name))
		}
	}
	if cur != nil {
		snap.Locks = append(snap.Locks, *cur)
	}
	return rows.Err()
}

// pgClient is the client address of a pg_stat_activity row, as host:port.
const pgClient = "COALESCE(host(a.client_addr) || ':' || a.client_port, 'local')"

// pgRowLocks finds forupdate's row locks: the visible version of a locked row of
// sqllock_rowlock carries the locking transaction's id in xmax, and a running
// transaction holds the lock on its own id (pg_locks) in its backend. A waiter waits
// in a statement on sqllock_rowlock; pg_blocking_pids leads to the holder (through
// the waiters before it).
func pgRowLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
	rows, err := db.QueryContext(ctx, `SELECT r.lock_key, r.name, r.token, a.pid, a.application_name, `+pgClient+`, a.state, `+
		s.micros("a.xact_start")+`
FROM sqllock_rowlock r
JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = r.xmax AND l.granted AND l.mode = 'ExclusiveLock'
JOIN pg_stat_activity a ON a.pid = l.pid
ORDER BY r.name`)
	if err != nil {
		return err
	}
	defer rows.Close()
	byPid := map[int64]int{} // holder backend -> index in snap.Locks
	for rows.Next() {
		var (
			key, name  []byte
			token, pid int64
			app, state sql.NullString
			client     string
			since      sql.NullInt64
		)
		if err := rows.Scan(&key, &name, &token, &pid, &app, &client, &state, &since); err != nil {
			return err
		}
		byPid[pid] = len(snap.Locks)
		snap.Locks = append(snap.Locks, Lock{Strategy: "forupdate", Name: ptr(string(name)), Key: keyHex(key),
			Holder: &Party{Host: ptr(client), Session: ptr(pid), Application: nullStr(app), State: nullStr(state)},
			Since:  microTime(since), Waiters: []Party{},
			Note: fmt.Sprintf("token: the holder's is uncommitted; the last committed is %d", token)})
	}
	if err := rows.Err(); err != nil {
		return err
	}
	rows.Close()
	rows, err = db.QueryContext(ctx, `SELECT a.pid, a.application_name, `+pgClient+`, a.state, `+s.micros("a.state_change")+`,
  array_to_string(pg_blocking_pids(a.pid), ',')
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.wait_event_type = 'Lock' AND a.query LIKE '%sqllock_rowlock%FOR UPDATE%'
ORDER BY a.state_change, a.pid`)
	if err != nil {
		return err
	}
	defer rows.Close()
	type waiter struct {
		p        Party
		blockers []int64
	}
	var ws []waiter
	for rows.Next() {
		var (
			pid        int64
			app, state sql.NullString
			client     string
			since      sql.NullInt64
			blockers   sql.NullString
		)
		if err := rows.Scan(&pid, &app, &client, &state, &since, &blockers); err != nil {
			return err
		}
		w := waiter{p: Party{Host: ptr(client), Session: ptr(pid), Application: nullStr(app), State: nullStr(state), Since: microTime(since)}}
		for _, b := range strings.Split(blockers.String, ",") {
			if n, err := strconv.ParseInt(b, 10, 64); err == nil {
				w.blockers = append(w.blockers, n)
			}
		}
		ws = append(ws, w)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	// Follow the blockers (a waiter queued behind another is blocked by it) to a holder.
	blockedBy := map[int64][]int64{}
	for _, w := range ws {
		blockedBy[*w.p.Session] = w.blockers
	}
	var find func(pid int64, depth int) (int, bool)
	find = func(pid int64, depth int) (int, bool) {
		if i, ok := byPid[pid]; ok {
			return i, true
		}
		if depth > 32 {
			return 0, false
		}
		for _, b := range blockedBy[pid] {
			if i, ok := find(b, depth+1); ok {
				return i, true
			}
		}
		return 0, false
	}
	for _, w := range ws {
		if i, ok := find(*w.p.Session, 0); ok {
			snap.Locks[i].Waiters = append(snap.Locks[i].Waiters, w.p)
		}
	}
	return nil
}

// candidateNames returns the names the library recorded in its tables, and those
// given with -name. The row of forupdate's MySQL counter (an empty name) is none.
func candidateNames(ctx context.Context, db *sql.DB, o statusOpts) ([]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT name FROM sqllock_fence UNION SELECT name FROM sqllock_lease
UNION SELECT name FROM sqllock_optimistic UNION SELECT name FROM sqllock_queue UNION SELECT name FROM sqllock_rowlock WHERE name <> ''`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	names := append([]string(nil), o.names...)
	for rows.Next() {
		var n []byte
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		names = append(names, string(n))
	}
	return names, rows.Err()
}

// pgAdvisoryLocks reads the advisory locks of the current database from pg_locks,
// with their sessions. Keys are mapped back to names by hashing the candidate names.
func pgAdvisoryLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot, o statusOpts) error {
	rows, err := db.QueryContext(ctx, `SELECT l.classid::bigint, l.objid::bigint, l.objsubid, l.mode, l.granted,
  a.pid, a.application_name, `+pgClient+`, a.state, `+s.micros("a.state_change")+`
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, a.state_change, a.pid`)
	if err != nil {
		return err
	}
	defer rows.Close()
	type entry struct {
		key   string
		k1k2  [2]int32
		pair  bool
		mode  string
		grant bool
		p     Party
	}
	var es []entry
	for rows.Next() {
		var (
			classid, objid, pid int64
			subid               int
			mode, client        string
			granted             bool
			app, state          sql.NullString
			since               sql.NullInt64
		)
		if err := rows.Scan(&classid, &objid, &subid, &mode, &granted, &pid, &app, &client, &state, &since); err != nil {
			return err
		}
		e := entry{mode: mode, grant: granted,
			p: Party{Host: ptr(client), Session: ptr(pid), Application: nullStr(app), State: nullStr(state)}}
		if !granted {
			e.p.Since = microTime(since)
		}
		if subid == 2 {
			e.pair, e.k1k2 = true, [2]int32{int32(uint32(classid)), int32(uint32(objid))}
			e.key = fmt.Sprintf("pg:%d:%d", e.k1k2[0], e.k1k2[1])
		} else {
			e.key = fmt.Sprintf("pg:bigint:%d", int64(uint64(classid)<<32|uint64(uint32(objid))))
		}
		es = append(es, e)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if len(es) == 0 {
		return nil
	}
	// The server-side lines of uniqueindex and optimistic are not advisory locks of
	// the advisory strategy: filed under their locks.
	targets, err := lineTargets(ctx, db, sqllock.Postgres, snap)
	if err != nil {
		return err
	}
	var lines []lineRec
	kept := es[:0]
	for _, e := range es {
		if t, ok := targets[strings.TrimPrefix(e.key, "pg:bigint:")]; ok && !e.pair {
			lines = append(lines, lineRec{strategy: t[0], key: t[1], waiting: !e.grant, p: e.p})
			continue
		}
		kept = append(kept, e)
	}
	es = kept
	attachLines(snap, lines)
	names := map[[2]int32]string{}
	cands, err := candidateNames(ctx, db, o)
	if err != nil {
		return err
	}
	ns := o.namespace
	if ns == "" {
		ns = advisory.DefaultNamespace
	}
	al, err := advisory.New(db, sqllock.Postgres, advisory.WithNamespace(ns))
	if err != nil {
		return err
	}
	defer al.Close()
	for _, n := range cands {
		k1, k2 := al.PostgresKeys(n)
		names[[2]int32{k1, k2}] = n
	}
	start := len(snap.Locks)
	byKey := map[string]int{}
	for _, e := range es {
		if e.grant {
			l := Lock{Strategy: "advisory", Key: e.key, Holder: ptr(e.p), Waiters: []Party{}}
			if n, ok := names[e.k1k2]; ok && e.pair {
				l.Name = ptr(n)
			} else {
				l.Note = "unknown name (pass it with -name)"
			}
			if e.mode == "ShareLock" {
				l.Note = strings.TrimPrefix(l.Note+"; shared", "; ")
			}
			if _, seen := byKey[e.key]; !seen {
				byKey[e.key] = len(snap.Locks)
			}
			snap.Locks = append(snap.Locks, l)
			continue
		}
		i, ok := byKey[e.key]
		if !ok { // waiters of a lock nobody in this database holds (a prepared transaction?)
			l := Lock{Strategy: "advisory", Key: e.key, Waiters: []Party{}, Note: "holder not visible"}
			if n, ok := names[e.k1k2]; ok && e.pair {
				l.Name = ptr(n)
			}
			i = len(snap.Locks)
			byKey[e.key] = i
			snap.Locks = append(snap.Locks, l)
		}
		snap.Locks[i].Waiters = append(snap.Locks[i].Waiters, e.p)
	}
	_ = start
	return nil
}

// myThreadCols are the columns that describe a MySQL session from
// performance_schema.threads t, with its connection attributes.
const myThreadCols = `t.PROCESSLIST_ID, t.PROCESSLIST_HOST, t.PROCESSLIST_COMMAND,
  (SELECT c.ATTR_VALUE FROM performance_schema.session_connect_attrs c WHERE c.PROCESSLIST_ID = t.PROCESSLIST_ID AND c.ATTR_NAME = '_pid'),
  (SELECT c.ATTR_VALUE FROM performance_schema.session_connect_attrs c WHERE c.PROCESSLIST_ID = t.PROCESSLIST_ID AND c.ATTR_NAME = 'program_name'),
  (SELECT c.ATTR_VALUE FROM performance_schema.session_connect_attrs c WHERE c.PROCESSLIST_ID = t.PROCESSLIST_ID AND c.ATTR_NAME = '_client_name')`

// scanThread reads myThreadCols into a Party.
type threadRow struct {
	id                               sql.NullInt64
	host, command, pid, prog, client sql.NullString
}

func (r *threadRow) dest() []any {
	return []any{&r.id, &r.host, &r.command, &r.pid, &r.prog, &r.client}
}

func (r *threadRow) party() Party {
	p := Party{Session: nullInt(r.id), Host: nullStr(r.host), State: nullStr(r.command)}
	if n, err := strconv.ParseInt(r.pid.String, 10, 64); err == nil && r.pid.Valid {
		p.PID = &n
	}
	switch {
	case r.prog.Valid:
		p.Application = &r.prog.String
	case r.client.Valid:
		p.Application = &r.client.String
	}
	return p
}

// myProcess reads sessions from the processlist (MariaDB, or MySQL without
// performance_schema's lock tables).
type myProcess struct {
	id            int64
	host, command string
	state, info   sql.NullString
	time          int64
}

func (p myProcess) party() Party {
	return Party{Session: ptr(p.id), Host: ptr(p.host), State: ptr(p.command)}
}

func processes(ctx context.Context, db *sql.DB, s *sqlDialect) (map[int64]myProcess, []myProcess, error) {
	rows, err := db.QueryContext(ctx, "SELECT ID, COALESCE(HOST, ''), COALESCE(COMMAND, ''), STATE, INFO, COALESCE(TIME, 0) FROM "+
		s.processlist+" ORDER BY TIME DESC, ID")
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	m := map[int64]myProcess{}
	var list []myProcess
	for rows.Next() {
		var p myProcess
		if err := rows.Scan(&p.id, &p.host, &p.command, &p.state, &p.info, &p.time); err != nil {
			return nil, nil, err
		}
		m[p.id] = p
		list = append(list, p)
	}
	return m, list, rows.Err()
}

// rowNames returns the names of sqllock_rowlock by hex key.
func rowNames(ctx context.Context, db *sql.DB, keys []string) (map[string]string, error) {
	out := map[string]string{}
	if len(keys) == 0 {
		return out, nil
	}
	args := make([]any, len(keys))
	for i, k := range keys {
		b, err := hex.DecodeString(k)
		if err != nil {
			return nil, err
		}
		args[i] = b
	}
	rows, err := db.QueryContext(ctx, "SELECT lock_key, name FROM sqllock_rowlock WHERE lock_key IN ("+
		strings.TrimSuffix(strings.Repeat("?, ", len(keys)), ", ")+")", args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var k, n []byte
		if err := rows.Scan(&k, &n); err != nil {
			return nil, err
		}
		out[keyHex(k)] = string(n)
	}
	return out, rows.Err()
}

// lockDataKey reads the primary key of sqllock_rowlock out of InnoDB's lock_data
// (a binary key is shown as 0x<hex>).
func lockDataKey(s string) (string, bool) {
	s = strings.TrimSpace(s)
	s = strings.TrimPrefix(strings.TrimPrefix(s, "0x"), "0X")
	if len(s) != 64 {
		return "", false
	}
	if _, err := hex.DecodeString(s); err != nil {
		return "", false
	}
	return strings.ToLower(s), true
}

// myRowLocks finds forupdate's row locks: on MySQL 8+ in performance_schema.data_locks
// (every lock, held or waited for); on MariaDB in information_schema.INNODB_LOCK_WAITS,
// which shows only locks that someone waits for.
func myRowLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot) error {
	type rec struct {
		key     string
		waiting bool
		p       Party
		since   *time.Time
	}
	var recs []rec
	var now int64
	if err := db.QueryRowContext(ctx, "SELECT "+s.micros("UTC_TIMESTAMP(6)")).Scan(&now); err != nil {
		return err
	}
	ago := func(us sql.NullInt64) *time.Time {
		if !us.Valid {
			return nil
		}
		return ptr(time.UnixMicro(now - us.Int64).UTC())
	}
	if !s.mariaDB {
		if !s.perfSchema {
			snap.Notes = append(snap.Notes, "forupdate: performance_schema is off: row locks are not visible")
			return nil
		}
		rows, err := db.QueryContext(ctx, `SELECT l.LOCK_DATA, l.LOCK_STATUS, `+myThreadCols+`,
  (SELECT TIMESTAMPDIFF(MICROSECOND, x.trx_started, NOW(6)) FROM information_schema.INNODB_TRX x WHERE x.trx_id = l.ENGINE_TRANSACTION_ID),
  (SELECT TIMESTAMPDIFF(MICROSECOND, x.trx_wait_started, NOW(6)) FROM information_schema.INNODB_TRX x WHERE x.trx_id = l.ENGINE_TRANSACTION_ID)
FROM performance_schema.data_locks l JOIN performance_schema.threads t ON t.THREAD_ID = l.THREAD_ID
WHERE l.OBJECT_SCHEMA = DATABASE() AND l.OBJECT_NAME = 'sqllock_rowlock' AND l.INDEX_NAME = 'PRIMARY' AND l.LOCK_TYPE = 'RECORD'
ORDER BY l.LOCK_STATUS = 'GRANTED' DESC, 9 DESC`)
		if err != nil {
			return fmt.Errorf("reading performance_schema.data_locks: %w", err)
		}
		defer rows.Close()
		seen := map[string]bool{}
		for rows.Next() {
			var (
				data, status sql.NullString
				tr           threadRow
				age, wait    sql.NullInt64
			)
			if err := rows.Scan(append(append([]any{&data, &status}, tr.dest()...), &age, &wait)...); err != nil {
				return err
			}
			k, ok := lockDataKey(data.String)
			if !ok {
				continue
			}
			r := rec{key: k, waiting: status.String != "GRANTED", p: tr.party()}
			if r.waiting {
				r.p.Since = ago(wait)
			} else {
				r.since = ago(age)
			}
			id := fmt.Sprint(k, r.waiting, tr.id.Int64)
			if seen[id] { // a REPLACEd row is locked twice (old and new record)
				continue
			}
			seen[id] = true
			recs = append(recs, r)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close()
	} else {
		byID, _, err := processes(ctx, db, s)
		if err != nil {
			return err
		}
		rows, err := db.QueryContext(ctx, `SELECT bl.lock_data, rt.trx_mysql_thread_id, bt.trx_mysql_thread_id, bt.trx_state,
  TIMESTAMPDIFF(MICROSECOND, bt.trx_started, NOW(6)), TIMESTAMPDIFF(MICROSECOND, rt.trx_wait_started, NOW(6))
FROM information_schema.INNODB_LOCK_WAITS w
JOIN information_schema.INNODB_LOCKS bl ON bl.lock_id = w.blocking_lock_id
JOIN information_schema.INNODB_TRX rt ON rt.trx_id = w.requesting_trx_id
JOIN information_schema.INNODB_TRX bt ON bt.trx_id = w.blocking_trx_id
WHERE bl.lock_table = CONCAT('`+"`"+`', DATABASE(), '`+"`.`sqllock_rowlock`"+`') AND bl.lock_index = 'PRIMARY'
ORDER BY 6 DESC`)
		if err != nil {
			return fmt.Errorf("reading information_schema.INNODB_LOCK_WAITS: %w", err)
		}
		defer rows.Close()
		holders, waiters := map[string]bool{}, map[string]bool{}
		for rows.Next() {
			var (
				data           sql.NullString
				waiter, holder int64
				hstate         sql.NullString
				hage, wage     sql.NullInt64
			)
			if err := rows.Scan(&data, &waiter, &holder, &hstate, &hage, &wage); err != nil {
				return err
			}
			k, ok := lockDataKey(data.String)
			if !ok {
				continue
			}
			if hstate.String != "LOCK WAIT" && !holders[k+strconv.FormatInt(holder, 10)] {
				holders[k+strconv.FormatInt(holder, 10)] = true
				p := Party{Session: ptr(holder)}
				if pr, ok := byID[holder]; ok {
					p = pr.party()
				}
				recs = append(recs, rec{key: k, p: p, since: ago(hage)})
			}
			if !waiters[k+strconv.FormatInt(waiter, 10)] {
				waiters[k+strconv.FormatInt(waiter, 10)] = true
				p := Party{Session: ptr(waiter)}
				if pr, ok := byID[waiter]; ok {
					p = pr.party()
				}
				p.Since = ago(wage)
				recs = append(recs, rec{key: k, waiting: true, p: p})
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close()
		snap.Notes = append(snap.Notes, "forupdate on MariaDB: InnoDB shows a row lock only while someone waits for it: holders without waiters are not listed")
	}
	var keys []string
	seenKey := map[string]bool{}
	for _, r := range recs {
		if !seenKey[r.key] {
			seenKey[r.key] = true
			keys = append(keys, r.key)
		}
	}
	names, err := rowNames(ctx, db, keys)
	if err != nil {
		return err
	}
	byKey := map[string]int{}
	for _, r := range recs { // holders first (ordered so), then waiters
		l, holder := snap.add(byKey, r.key, func() Lock {
			l := Lock{Strategy: "forupdate", Key: r.key, Waiters: []Party{}, Note: "token: the holder's is uncommitted"}
			if n, ok := names[r.key]; ok {
				l.Name = ptr(n)
			}
			return l
		}, r.p, r.waiting)
		if holder {
			l.Since = r.since
		}
	}
	return nil
}

var getLockRe = regexp.MustCompile(`GET_LOCK\('(sqllock:[0-9a-f]+)', *([0-9.]+)\)`)

// lineRe finds the strategy and hex key of a line's GET_LOCK name (wait.MyLineName)
// in a statement's text.
var lineRe = regexp.MustCompile(`CONCAT_WS\(':', COALESCE\(DATABASE\(\), ''\), '(\w+)', HEX\(X'([0-9a-fA-F]+)'\)\)`)

// myAdvisoryLocks finds GET_LOCK locks named sqllock:<hex>: on MySQL in
// performance_schema.metadata_locks; on MariaDB with METADATA_LOCK_INFO if the plugin
// is installed, and by IS_USED_LOCK on the lock names of every known name and of
// every waiter's statement, waiters from the processlist.
func myAdvisoryLocks(ctx context.Context, db *sql.DB, s *sqlDialect, snap *snapshot, o statusOpts) error {
	al, err := advisory.New(db, sqllock.MySQL, nsOption(o)...)
	if err != nil {
		return err
	}
	defer al.Close()
	type rec struct {
		lockName string
		waiting  bool
		p        Party
	}
	var recs []rec
	lookup := map[string]string{} // GET_LOCK name -> name
	mapNames := func() error {
		cands, err := candidateNames(ctx, db, o)
		if err != nil {
			return err
		}
		for _, n := range cands {
			ln, err := al.MySQLLockName(ctx, n)
			if err != nil {
				return err
			}
			lookup[ln] = n
		}
		return nil
	}
	var targets map[string][2]string // the lines of the held locks (lineTargets), once read
	if !s.mariaDB && s.perfSchema {
		rows, err := db.QueryContext(ctx, `SELECT m.OBJECT_NAME, m.LOCK_STATUS, `+myThreadCols+`
FROM performance_schema.metadata_locks m JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID
WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK' AND m.OBJECT_NAME LIKE 'sqllock:%'
ORDER BY m.OBJECT_NAME, m.LOCK_STATUS = 'GRANTED' DESC, m.OWNER_EVENT_ID`)
		if err != nil {
			return fmt.Errorf("reading performance_schema.metadata_locks: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			var (
				name, status sql.NullString
				tr           threadRow
			)
			if err := rows.Scan(append([]any{&name, &status}, tr.dest()...)...); err != nil {
				return err
			}
			recs = append(recs, rec{lockName: name.String, waiting: status.String != "GRANTED", p: tr.party()})
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close()
		if recs, err = routeLines(ctx, db, snap, nil, recs, func(r rec) (string, bool, Party) { return r.lockName, r.waiting, r.p }); err != nil {
			return err
		}
		if len(recs) > 0 {
			if err := mapNames(); err != nil {
				return err
			}
		}
	} else {
		byID, list, err := processes(ctx, db, s)
		if err != nil {
			return err
		}
		if err := mapNames(); err != nil {
			return err
		}
		cands := map[string]bool{}
		for ln := range lookup {
			cands[ln] = true
		}
		if targets, err = lineTargets(ctx, db, sqllock.MySQL, snap); err != nil {
			return err
		}
		for ln := range targets { // the lines' holders, by IS_USED_LOCK below
			cands[ln] = true
		}
		dbName := ""
		for _, p := range list { // the lines' waiters
			if m := lineRe.FindStringSubmatch(p.info.String); m != nil && strings.Contains(strings.ToLower(p.state.String), "user lock") &&
				slices.Contains(wait.LineSpaces, m[1]) { // (not a fairqueue waiter's: listed from the tickets)
				w := p.party()
				w.Since = ptr(time.Now().UTC().Add(-time.Duration(p.time) * time.Second))
				if dbName == "" {
					dbName = dbNameOf(ctx, db)
				}
				recs = append(recs, rec{lockName: myLineName(dbName, m[1], m[2]), waiting: true, p: w})
			}
		}
		// Waiters: sessions in a GET_LOCK that waits (the library's first attempt does not).
		for _, p := range list {
			m := getLockRe.FindStringSubmatch(p.info.String)
			if m == nil {
				continue
			}
			if t, err := strconv.ParseFloat(m[2], 64); err != nil || t == 0 {
				continue
			}
			cands[m[1]] = true
			w := p.party()
			w.Since = ptr(time.Now().UTC().Add(-time.Duration(p.time) * time.Second))
			recs = append(recs, rec{lockName: m[1], waiting: true, p: w})
		}
		holders := map[string]int64{}
		if s.metadataLockInfo {
			rows, err := db.QueryContext(ctx, `SELECT THREAD_ID, TABLE_SCHEMA FROM information_schema.METADATA_LOCK_INFO
WHERE LOCK_TYPE = 'User lock' AND TABLE_SCHEMA LIKE 'sqllock:%'`)
			if err != nil {
				return fmt.Errorf("reading information_schema.METADATA_LOCK_INFO: %w", err)
			}
			for rows.Next() {
				var id int64
				var ln string
				if err := rows.Scan(&id, &ln); err != nil {
					rows.Close()
					return err
				}
				holders[ln] = id
			}
			if err := rows.Close(); err != nil {
				return err
			}
		}
		list2 := make([]string, 0, len(cands))
		for ln := range cands {
			if _, ok := holders[ln]; !ok {
				list2 = append(list2, ln)
			}
		}
		sort.Strings(list2)
		used, err := isUsedLocks(ctx, db, list2)
		if err != nil {
			return err
		}
		for ln, id := range used {
			holders[ln] = id
		}
		var hl []string
		for ln := range holders {
			hl = append(hl, ln)
		}
		sort.Strings(hl)
		for _, ln := range hl {
			p := Party{Session: ptr(holders[ln])}
			if pr, ok := byID[holders[ln]]; ok {
				p = pr.party()
			}
			recs = append([]rec{{lockName: ln, p: p}}, recs...)
		}
		if s.metadataLockInfo {
			snap.Notes = append(snap.Notes, "advisory: holders from METADATA_LOCK_INFO, waiters from the processlist")
		} else {
			snap.Notes = append(snap.Notes, "advisory: no lock table on this server (performance_schema off, no METADATA_LOCK_INFO plugin): "+
				"holders found by IS_USED_LOCK on the names the library recorded, -name and waiters' statements; "+
				"a lock of another name that nobody waits for is not seen")
		}
	}
	// Holders first, then waiters.
	sort.SliceStable(recs, func(i, j int) bool { return !recs[i].waiting && recs[j].waiting })
	if s.mariaDB || !s.perfSchema { // (performance_schema's records were routed as read)
		if recs, err = routeLines(ctx, db, snap, targets, recs, func(r rec) (string, bool, Party) { return r.lockName, r.waiting, r.p }); err != nil {
			return err
		}
	}
	byKey := map[string]int{}
	for _, r := range recs {
		snap.add(byKey, r.lockName, func() Lock {
			l := Lock{Strategy: "advisory", Key: r.lockName, Waiters: []Party{}}
			if n, ok := lookup[r.lockName]; ok {
				l.Name = ptr(n)
			} else {
				l.Note = "unknown name (pass it with -name)"
			}
			return l
		}, r.p, r.waiting)
	}
	return nil
}

func nsOption(o statusOpts) []advisory.Option {
	if o.namespace == "" {
		return nil
	}
	return []advisory.Option{advisory.WithNamespace(o.namespace)}
}

// isUsedLocks asks IS_USED_LOCK for each GET_LOCK name, in batches, and returns the
// holders' connection ids of those held.
func isUsedLocks(ctx context.Context, db *sql.DB, names []string) (map[string]int64, error) {
	out := map[string]int64{}
	for len(names) > 0 {
		batch := names[:min(len(names), 500)]
		names = names[len(batch):]
		var b strings.Builder
		args := make([]any, len(batch))
		b.WriteString("SELECT n, IS_USED_LOCK(n) FROM (")
		for i, n := range batch {
			if i > 0 {
				b.WriteString(" UNION ALL ")
			}
			b.WriteString("SELECT CAST(? AS CHAR) AS n")
			args[i] = n
		}
		b.WriteString(") c")
		rows, err := db.QueryContext(ctx, b.String(), args...)
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			var n string
			var id sql.NullInt64
			if err := rows.Scan(&n, &id); err != nil {
				rows.Close()
				return nil, err
			}
			if id.Valid {
				out[n] = id.Int64
			}
		}
		if err := rows.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}
