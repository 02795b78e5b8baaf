// Package advisory implements sqllock.Locker with the locks the database server keeps
// for a session: pg_advisory_lock and its shared, try and transaction-scoped forms on
// PostgreSQL, and GET_LOCK / RELEASE_LOCK on MySQL and MariaDB. It is the fastest
// strategy of this module: an uncontended acquisition is one statement, plus one for
// the fencing token unless WithoutToken is given.
//
// # Sessions
//
// A session lock is held while the database session that took it lives. Every held
// lock therefore pins its own *sql.Conn, taken from the pool at Acquire and given back
// by Release (after the unlock statement), so a pool of N connections holds at most N
// locks at once, and a blocked Acquire first waits for a free connection (honouring
// its context). A keepalive pings the pinned session every keepalive interval
// (DefaultKeepalive, see WithKeepalive) and compares its session id (pg_backend_pid(),
// CONNECTION_ID()) with the one captured in the locking statement; on MySQL it also
// checks IS_USED_LOCK. If the session died (killed, cut, server restarted or failed
// over) the lease's Done channel closes and Err and Release report sqllock.ErrLost.
//
// The server frees a dead session's locks at once, so another client may acquire the
// lock before the old holder's keepalive notices: loss is signalled within one
// keepalive interval (plus the ping timeout), not before. Protect the resource with
// the fencing token (Lease.Token) when that window matters.
//
// A pinned *sql.Conn never reconnects behind the holder's back (database/sql reports
// driver.ErrBadConn), and the session id comparison catches any layer that would.
//
// # Poolers
//
// Session locks do not work behind a pooler in transaction mode (pgbouncer
// pool_mode=transaction, ProxySQL with multiplexing, Amazon RDS Proxy when not
// pinned): the next statement may run on another server session, so the lock could
// be held by a session nobody uses or released by nobody. The keepalive detects a
// changed backend id and reports ErrLost, but exclusion cannot be trusted meanwhile.
// Behind such poolers on PostgreSQL use AcquireTx, which holds the lock for one
// transaction (pg_advisory_xact_lock); on MySQL use a row-based strategy
// (forupdate, uniqueindex).
//
// # Keys
//
// On PostgreSQL a name maps to the two-int4 form of the advisory lock key:
// pg_advisory_lock(k1, k2), where k1 and k2 are the 64 leading bits of
// SHA-256(namespace, 0, name) (namespace DefaultNamespace unless WithNamespace). In
// pg_locks these appear with objsubid = 2, while keys taken with a single bigint
// (golang-migrate, most libraries, AcquireKey here) appear with objsubid = 1: the two
// spaces never collide, and within ours two names collide only with probability about
// 2^-64 (hashtext is not used: it is 32 bits and 'lock-8327' and 'lock-68168' collide).
// AcquireKey and TryAcquireKey take a raw int64 in the bigint space, for interoperation
// with code that uses pg_advisory_lock(bigint) directly. PostgreSQL advisory keys are
// per database.
//
// On MySQL, GET_LOCK names are server-wide and limited (64 characters on MySQL, 192 on
// MariaDB; MariaDB also cuts names at a NUL byte). A name maps to "sqllock:" followed
// by 56 hex digits (224 bits) of SHA-256(namespace, 0, name), 64 characters in all,
// where the namespace is the current database (DATABASE(), read once) unless
// WithNamespace sets it: the same name in two databases of one server is two locks.
// No name is ever truncated; Lease.Name returns the original.
//
// # Modes
//
// Shared returns a view of a PostgreSQL Locker that takes shared locks
// (pg_advisory_lock_shared): any number of shared holders, excluded by an exclusive
// holder. Reentrancy is off by default: a second Acquire of a held name blocks, even
// from the same Locker, because it pins another session. With sqllock.WithOwner the
// acquisitions of one owner key on one Locker share one session and count holds; the
// server lock is released by the last Release.
//
// # Cancellation
//
// When the context of a blocked Acquire ends, the waiting statement is cancelled (on
// PostgreSQL with pgx by a cancel request, otherwise by closing the connection) and
// the pinned connection is closed rather than returned to the pool, so a lock granted
// at that instant dies with its session. Other locks, pinned to other sessions, are
// not affected.
package advisory
