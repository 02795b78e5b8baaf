package advisory

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

	"github.com/sqllock/sqllock/internal/deploy"
	"github.com/sqllock/sqllock/internal/direct"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/lease"
)

// A session lock is only as good as the session: behind a transaction-pooling proxy
// (pgbouncer pool_mode=transaction, RDS Proxy, Supavisor in transaction mode) the
// statements of one client connection run on whichever server backend is free, so a
// lock is taken on one backend, unlocked (or re-entered by another client!) on
// another, and left held on a pooled backend. The Locker notices it in two ways, at
// no extra round trip:
//
//   - every PostgreSQL locking statement reads the session's stamp (a custom setting,
//     sqllock.session) before writing its own: the stamp of this client connection,
//     made of a random per-process part and the identity of the pgx connection. On a
//     real session the stamp read is empty or its own. Another client's stamp means
//     that two client connections share a backend: a pooler.
//   - the keep-alive and the unlock return pg_backend_pid(), compared with the
//     backend that took the lock. It must be the same statement: a second one could
//     run on the lock's backend again, and the lock would be taken for gone. The
//     unlock unlocks only on that backend. With pgx's statement cache (the DSN's
//     default) a statement the cache prepared on one backend fails on another
//     (42P05, 26000) without running: it runs again by the simple protocol.
//
// From then on the Locker refuses (ErrUnsafeDeployment): the lease it was taking is
// given back, the lease whose session moved ends with ErrLost, and the backend left
// holding a lock is freed: unlocked if the pooler hands that backend to the Locker's
// statement, else terminated once it is idle, waited for in the background for up to
// 5 s if another client is using it (pg_terminate_backend of a backend of the same
// role: the proxy drops that server connection and the lock dies with it). The
// freeing statement goes by the simple protocol, so that pgx's statement cache does
// not make it fail there.
// AcquireTx, whose lock is scoped to the caller's transaction, is the pooler-safe
// form. In pgbouncer's session mode a client keeps its backend and DISCARD ALL clears
// both locks and stamp when it leaves: session locks are safe there.

// procStamp is the per-process part of the session stamps.
var procStamp = func() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}()

// sessionStamp returns the stamp of conn's client session, or "" with a driver other
// than pgx (no check then).
func sessionStamp(conn *sql.Conn) string {
	pgc := interrupt.PgConn(conn)
	if pgc == nil {
		return ""
	}
	// The backend key the client was given at connect: unique per server session,
	// and per client connection behind pgbouncer (which hands out its own).
	return procStamp + "-" + strconv.FormatUint(uint64(pgc.PID()), 10) + "-" + hex.EncodeToString(pgc.SecretKey())
}

// foreignStamp reports whether prev, the stamp a locking statement read on its
// backend, belongs to another client connection than stamp.
func foreignStamp(stamp string, prev sql.NullString) bool {
	return stamp != "" && prev.Valid && prev.String != "" && prev.String != stamp
}

// poolerSeen makes the Locker refuse from now on, with why, and returns the refusal.
func (l *Locker) poolerSeen(why string) error {
	err := deploy.Refusal("advisory: " + why + ": a transaction-pooling proxy (pgbouncer pool_mode=transaction?) " +
		"is between the client and PostgreSQL, so session locks do not stay with the session; " +
		"use AcquireTx (transaction-scoped locks), a session-mode pool, or a direct connection")
	if l.st.pooled.CompareAndSwap(nil, &err) {
		l.cfg.Logger.Error("sqllock/advisory: "+err.Error()+"; the Locker refuses from now on", "dialect", l.dialect.String())
	}
	return *l.st.pooled.Load()
}

// leftBehind looks at ranOn, the backend that a statement meant for backend sid (the
// one holding the lock) ran on. If it is another backend, the lock may be left on
// sid: the Locker refuses from now on, sid is freed (freeBackend), and leftBehind
// returns the refusal. Otherwise it returns nil. what names the statement, for the
// refusal.
func (l *Locker) leftBehind(ctx context.Context, sid, ranOn int64, what string) error {
	if ranOn == sid {
		return nil
	}
	refusal := l.poolerSeen(fmt.Sprintf("%s on backend %d ran on backend %d", what, sid, ranOn))
	l.freeBackend(ctx, sid)
	return refusal
}

// freeBackend frees backend pid, a session of this role left holding an advisory
// lock behind a pooler: a lock left on a pooled server connection must not outlive
// the lease. If the statement runs on that backend itself (the pooler hands it out
// again) it unlocks the backend's session locks there; otherwise it terminates the
// backend once it has been idle for freeIdle, and the lock dies with it. It works in
// the background, so that the caller (Release, Acquire, the keep-alive) returns at
// once and gives its connection back first (an application pool of one connection
// has none to spare for it until then): it polls a backend in use by another client
// (a statement or a transaction of that client's) every freePoll, for up to
// lease.GiveBackTimeout. Close waits for it. Behind a transaction-pooling proxy the
// backend is free again when the other client's transaction ends.
//
// The termination races with the proxy: between the statement's look at the
// backend and pg_terminate_backend the proxy may hand that backend to another
// client, whose transaction then fails with a terminated connection. Requiring
// freeIdle of idleness makes it rare (a proxy hands out its most recently used
// server connections first), not impossible. Best effort: logged, never an error.
func (l *Locker) freeBackend(ctx context.Context, pid int64) {
	l.st.freeing.Go(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lease.GiveBackTimeout)
		defer cancel()
		if l.freeAttempt(ctx, pid) {
			return
		}
		l.cfg.Logger.Warn("sqllock/advisory: the pooled backend left holding a lock is in use; waiting for it to be idle",
			"pid", pid)
		t := time.NewTicker(freePoll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				l.cfg.Logger.Warn("sqllock/advisory: the pooled backend left holding a lock stayed in use; giving up",
					"pid", pid, "waited", lease.GiveBackTimeout)
				return
			case <-t.C:
			}
			if l.freeAttempt(ctx, pid) {
				return
			}
		}
	})
}

// freeAttempt makes one attempt of freeBackend's, bounded by ctx, and reports
// whether it is done: the backend was freed or holds nothing, or the attempt failed
// (logged). It reports false while the backend is in use.
func (l *Locker) freeAttempt(ctx context.Context, pid int64) bool {
	// holding: the backend still exists and holds an advisory lock; freed: its locks
	// were unlocked here, or it was idle long enough and is terminated (CASE
	// evaluates the branch it takes only).
	var holding, freed int64
	conn, err := l.db.Conn(ctx)
	if err == nil {
		// Unprepared: behind the proxy, a statement pgx prepared may be missing, or
		// exist already, on the backend the proxy hands out.
		err = direct.Unprepared(ctx, conn, `SELECT count(*), coalesce(sum(CASE
    WHEN a.pid = pg_backend_pid() THEN (SELECT 1 FROM pg_advisory_unlock_all() WHERE a.pid = pg_backend_pid())
    WHEN a.state = 'idle' AND a.state_change < clock_timestamp() - $2::interval AND pg_terminate_backend(a.pid) THEN 1
    ELSE 0 END), 0)
FROM pg_stat_activity a
WHERE a.pid = $1 AND a.backend_type = 'client backend' AND a.usename = current_user
  AND EXISTS (SELECT 1 FROM pg_locks k WHERE k.pid = a.pid AND k.locktype = 'advisory' AND k.granted)`,
			[]any{pid, freeIdle.String()}, &holding, &freed)
		conn.Close()
	}
	if err != nil || holding == 0 || freed > 0 {
		l.cfg.Logger.Warn("sqllock/advisory: freeing the pooled backend left holding a lock",
			"pid", pid, "holding", holding, "freed", freed, "err", err)
		return true
	}
	return false
}

const (
	// freePoll is how often freeBackend looks again at a backend in use.
	freePoll = 10 * time.Millisecond
	// freeIdle is how long a backend must have been idle before freeBackend
	// terminates it.
	freeIdle = 50 * time.Millisecond
)
