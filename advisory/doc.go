// Package advisory implements sqllock.Locker with the locks the database server keeps
// for a session: pg_advisory_lock and its shared, try and transaction-scoped forms on
// PostgreSQL, and GET_LOCK / RELEASE_LOCK on MySQL and MariaDB. It is the fastest
// strategy of this module: an uncontended acquisition is one statement, which also
// draws the fencing token (no commit of its own), and the release one more. With
// several processes contending for a name, an acquisition is the waiting lock
// statement and the release, plus on MySQL one statement for the token (drawn after
// the wait: a statement that may wait never touches the token's table). On MySQL
// these counts hold for the sessions the Locker keeps for reuse; a session new from
// the pool costs a statement that sets its bound, and its first lock statement also
// reads its CONNECTION_ID() (for KILL QUERY) and draws the token separately. See
// Lease.Token for how tokens stay increasing across server crashes.
//
// # Sessions
//
// A session lock is held while the database session that took it lives. Every held
// lock therefore pins its own *sql.Conn, taken from the pool at Acquire and given back
// by Release (after the unlock statement), so a pool of N connections holds at most N
// locks at once, and a blocked Acquire first waits for a free connection (honouring
// its context).
//
// While it holds a lock, the session carries a bound the server enforces: it is ended
// by the server once it has been idle for the Locker's TTL (DefaultTTL, see WithTTL;
// idle_session_timeout and tcp_user_timeout on PostgreSQL 14 and later, set in the
// locking statement; wait_timeout and net_write_timeout on MySQL, in whole seconds),
// which frees the lock. A keep-alive runs a statement on the session every keep-alive
// interval (DefaultKeepalive), which restarts that idle timer, and compares its
// session id (pg_backend_pid(), CONNECTION_ID()) with the one the session had when it
// took the lock (read by the locking statement on PostgreSQL and by the first lock
// statement of the session on MySQL); on MySQL it also checks IS_USED_LOCK. If no keep-alive succeeded for the
// TTL less a safety margin (TTL/5), on the client's clock, the lease ends with
// sqllock.ErrLost: a holder cut off from the server is told before the server frees
// the lock, and a dead holder's lock is free within the TTL, not when TCP gives up
// hours later. The settings are put back before the session returns to the pool: on
// PostgreSQL in the unlock statement (no round trip is added), except that a Locker
// that takes locks back to back keeps a few sessions for a moment with their bound
// still set, and their lock and unlock statements leave the settings alone; on MySQL
// the Locker keeps a few configured sessions for a moment to reuse them. A kept
// session's settings are put back by a statement of its own when it leaves the Locker
// (after about TTL/4, at most 2s, unused, or at Close).
//
// If the session is killed from outside (an operator's KILL, pg_terminate_backend,
// a server restart), the server frees the lock at once, and the holder learns it
// within one keep-alive interval (measured: 2s with the defaults): another client may
// acquire the lock before that. Nothing can foresee a KILL: protect the resource
// with the fencing token (Lease.Token) when that window matters.
//
// A pinned *sql.Conn never reconnects behind the holder's back (database/sql reports
// driver.ErrBadConn), and the session id comparison catches any layer that would.
//
// # Poolers and clusters
//
// Session locks do not work behind a pooler in transaction mode (pgbouncer
// pool_mode=transaction, ProxySQL with multiplexing, Amazon RDS Proxy when not
// pinned): the next statement may run on another server session, so the lock could
// be held by a session nobody uses, re-entered by another client, or released by
// nobody. On PostgreSQL the Locker detects it at no extra round trip: each locking
// statement reads a stamp its client connection left on the session
// (sqllock.session) and finds another client's, or the keep-alive or an unlock runs
// on another backend than the lock's. From then on the Locker refuses with
// sqllock.ErrUnsafeDeployment, gives back what it was taking, ends the held lease
// with sqllock.ErrLost, and frees the backend left holding the lock (unlocks it
// there, or terminates it once it is idle; while another client uses it, in the
// background for up to 5 s, which Close waits for). Detection needs the pooler to
// move a session at least once, so exclusion before that cannot be trusted either:
// behind such poolers on PostgreSQL use AcquireTx, which holds the lock for one
// transaction (pg_advisory_xact_lock); on MySQL use a row-based strategy
// (uniqueindex). pgbouncer in session mode keeps a client on one backend and clears
// its locks (DISCARD ALL) when it leaves: safe.
//
// On a MariaDB Galera node (wsrep_on=ON) GET_LOCK is local to the node: clients of
// two nodes would both hold the lock. The Locker's first acquisition refuses with
// sqllock.ErrUnsafeDeployment unless WithGaleraSingleWriter states that every client
// reaches the same node. The same goes for a MySQL Group Replication member in
// multi-primary mode and for a single-primary group's secondaries; its primary is
// accepted. With tokens (the default) every member of a running group is refused,
// promise or not: the tokens' MEMORY table takes no writes there (error 3098); use
// WithoutToken on the primary.
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
