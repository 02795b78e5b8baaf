// Package forupdate implements locks that are row locks of an open transaction
// (SELECT ... FOR UPDATE), on PostgreSQL and MySQL/MariaDB. Its strength is that the
// lock and the business writes made in the same transaction commit together: a holder
// that dies takes its uncommitted work with it.
//
// # What the lock is
//
// Each lock name has a row in sqllock_rowlock (migration 0003), keyed by SHA-256 of the
// name, with the original bytes kept for display. Holding the lock means holding the
// exclusive row lock on that row inside an open transaction on one connection.
// COMMIT (Lease.Release) or ROLLBACK (Lease.Rollback) releases the lock.
//
// The statement that takes the row lock also draws the lease's fencing token, once
// the lock is granted (after any wait for it, so tokens grow in the order the lock
// is granted), from a source that a rollback does not undo (on PostgreSQL
// epoch-prefixed values of a sequence, fence.EpochPostgres; on MySQL the
// AUTO_INCREMENT counter, by REPLACEing the locked row, raised to the epoch of the
// server's run << 44 before a session draws), and stores it in the row, where it
// commits or rolls back with the business writes. So Lease.Token is strictly
// increasing per name even across holders that rolled back or whose session died (a
// token incremented in the row alone would be handed out again after such a holder,
// defeating fencing), and across crashes of the server (a value drawn but never made
// durable is below the next run's epoch) and failovers (a promoted standby or replica
// starts a run of its own: on MySQL the run is the server's @@server_id's, so a
// replica does not go on in its former source's run; with lossless semi-synchronous
// replication its epoch is above every epoch of the source, and its tokens above the
// token of a lease still held on the source), and the row shows the token of the last
// committed holder. On MySQL Group Replication, which refuses the MEMORY table that
// marks a run, tokens are not protected across a crash (logged once per Locker).
//
// Rows are created on first use with an autocommit INSERT, outside the waiting
// transaction, so concurrent first use of a name neither deadlocks nor fails
// (InnoDB takes gap locks when a locking read finds no row at REPEATABLE READ). Rows are
// never deleted by the library.
//
// # The bound, and failure
//
// A lock transaction carries a bound the server enforces: it is ended (and the lock
// freed) once it has been idle, with no statement running, for the Locker's TTL
// (DefaultTTL, see WithTTL): idle_in_transaction_session_timeout and tcp_user_timeout
// on PostgreSQL, set for the transaction only; wait_timeout and net_write_timeout on
// MySQL, in whole seconds, put back when the connection returns to the pool. The
// keep-alive (every DefaultKeepalive, see WithKeepalive) looks at the transaction
// from another pooled connection, so that it never interferes with the caller's
// statements: on PostgreSQL it finds the session in the lease's transaction
// (pg_stat_activity, xact_start and backend_start, so a reused pid is not taken for
// it) and, when the transaction is idle and the driver is pgx, touches it through its
// own connection (which restarts the idle timer); on MySQL it reads the session in
// the processlist (a Sleep of TIME seconds leaves TTL less that much), the server's
// uptime (a restart reuses session ids) and the committed token (one at least the
// lease's means the transaction committed early). So:
//
//   - On MySQL only the caller's statements keep a lock transaction alive: a lease
//     whose transaction runs no statement for the TTL (less the safety margin, TTL/5)
//     ends with ErrLost, just before the server would end the transaction. Raise the
//     TTL for work that spends long outside SQL while holding the lock. On PostgreSQL
//     with pgx the keep-alive touches an idle transaction itself.
//   - A single statement that runs longer than the TTL less the safety margin makes the
//     lease end with ErrLost on PostgreSQL when the keep-alive cannot see it running
//     (a driver other than pgx); on MySQL a running statement counts as activity.
//   - A holder cut off from the database is told (Done, ErrLost) before the server
//     ends its transaction and frees the lock: within the TTL.
//
// When the session dies (killed, connection cut, server restart or failover), the
// database rolls the transaction back: the lock is free at once and nothing of the
// work done in Lease.Tx commits. If it was killed from outside (an operator's KILL),
// the lease learns it within about one keep-alive interval (measured: 5s with the
// defaults), after another client may already have acquired the lock; this is safe
// for writes made through Lease.Tx, which can no longer commit, but not for side
// effects outside the database: pass Lease.Token to such resources.
//
// # Clusters and poolers
//
// On a MariaDB Galera node (wsrep_on=ON) a FOR UPDATE row lock is local to the node:
// clients on two nodes both hold it, and one of them fails only at COMMIT, when
// certification aborts it (Release then returns an error matching ErrLost, nothing
// committed). The Locker's first acquisition refuses such a node with
// sqllock.ErrUnsafeDeployment unless WithGaleraSingleWriter states that every client
// reaches the same node. The same goes for a MySQL Group Replication member in
// multi-primary mode (measured there with the promise broken: 441 lost updates of
// 1542) and for a single-primary group's secondaries; its primary is accepted. On
// PostgreSQL with asynchronous standbys the Locker logs a
// warning (tokens may repeat after a failover), or refuses with
// WithRequireSyncReplication. A transaction-pooling proxy (pgbouncer
// pool_mode=transaction) keeps a transaction on one server session: forupdate works
// there (with pgx's default_query_exec_mode=simple_protocol).
//
// # What ends a lock early
//
// On MySQL a DDL statement or LOCK TABLES inside the transaction commits it
// implicitly, and InnoDB rolls back the whole transaction of a deadlock victim (and,
// with innodb_rollback_on_timeout, of a lock wait timeout): the lock is free from
// then on, and later statements through Lease.Tx run outside any transaction. The
// keep-alive reports ErrLost within one interval (an early commit), and Release
// checks that the transaction is still the lease's before COMMIT: if not, it rolls
// back what it can and returns ErrLost. Do not run such statements inside a lock.
// On PostgreSQL DDL is transactional, but any error in the transaction (a failed
// statement of yours, a deadlock) aborts it, and the abort releases its locks at
// once, although the transaction block stays open until ROLLBACK: another client can
// take the lock from then on. The keep-alive reports ErrLost within one interval,
// and Release returns ErrLost (nothing was committed). Wrap a statement that may
// fail in a SAVEPOINT if the lock must survive its failure.
//
// # Reads inside the transaction
//
// Every holder's writes were committed before the next holder is granted the lock.
// Under READ COMMITTED (the PostgreSQL default) each statement in the transaction sees
// them. Under REPEATABLE READ on PostgreSQL the snapshot is taken by the locking
// statement itself; a waiter whose snapshot predates the previous holder's commit gets
// a serialization failure, which the library retries in a new transaction, so the
// snapshot a lease gets always includes every earlier holder's commit. Under
// REPEATABLE READ on MySQL (the InnoDB default) the locking statement is a locking
// read, which reads the latest committed row, and the snapshot is established by the
// first plain SELECT inside the lease, after the lock was granted. Either way, reads of
// data that only lock holders write are current for the whole lease.
//
// # Cost
//
// Each held lock and each waiter blocked in the database occupies one pooled
// connection for as long as it holds or waits. A burst of waiters on a busy name can
// therefore take every connection of an application's pool; WithMaxWaiters caps the
// number of waiters per Locker that may block in the database at once (the others
// wait in the process, holding no connection). Holders are not counted: bound them as
// you bound any transaction.
//
// An acquisition costs three statements, contended or not, with a token or
// WithoutToken (on MySQL 8 and later, see below for a token with a ctx deadline):
// BEGIN, the locking statement, and COMMIT at release, as many as a
// hand-written SELECT ... FOR UPDATE transaction. With a token the locking statement
// draws it too: on PostgreSQL an UPDATE of the row over the locking read (WITH ...
// SELECT ... FOR UPDATE), whose token is computed on the row the locking read
// returns, so once the lock is held; on MySQL a REPLACE of the row by a copy whose
// name a SELECT ... FOR UPDATE subquery reads, which takes the lock before the insert
// draws the AUTO_INCREMENT value. A ctx deadline bounds the wait on the server too,
// at no extra statement but on MySQL 8 and later: on
// PostgreSQL a transaction-local lock_timeout, set by the locking statement before
// it waits and put back by the same statement once the lock is held; on MariaDB a
// statement-scoped innodb_lock_wait_timeout (SET STATEMENT). MySQL 8 and later have
// no statement-scoped bound but MAX_EXECUTION_TIME, which ends only a SELECT: there
// an acquisition with a token and a ctx deadline first tries to take the lock at
// once (REPLACE ... NOWAIT: three statements when the lock is free); if the lock is
// held, it waits in a bounded SELECT ... FOR UPDATE and draws in a second statement,
// once the lock is held (five statements), and the Locker's next 16 such
// acquisitions, of any name, go straight to the bounded wait (four, also for a free
// lock), so that steady contention costs the try about once in 17. The try does not
// wait for row locks; a metadata lock (a DDL statement on the table under way) it
// waits for as any statement does, bounded by lock_wait_timeout and the client's
// interrupt at the deadline. On PostgreSQL a table lock (a DDL statement under way)
// is waited for before the locking statement sets its lock_timeout, so the client's
// cancel request ends that wait, 200 ms (interrupt.ServerBoundGrace) after the
// deadline (TestDeadlineBoundsTableLockWait).
// The server's version is asked once per Locker. A waiter sends nothing while it
// waits: the database queues it on the row lock and wakes it when the holder ends.
//
// More statements: on MySQL, each pinned session (see WithTTL: a pooled connection
// whose wait_timeout the Locker set, kept for reuse while the pool has room) is set
// up, asked its CONNECTION_ID() once with a token (without, the locking read
// returns it) and put back when it returns to the pool; Release
// after Tx was called checks the transaction before COMMIT; an isolation level other
// than the default is one SET TRANSACTION; TryAcquireAny looks for missing rows
// first and draws the token in a second statement. On PostgreSQL with a driver other
// than pgx each attempt asks its session's pid (pg_backend_pid()). The first
// acquisition of a name creates its row, and the first token of a PostgreSQL
// server's run records the run's epoch (see fence.Drawn). On MySQL, with a token, the
// query of a session's CONNECTION_ID() also reads the run's epoch and the epoch the
// counter was raised to; in a new run the first session records the epoch (a write
// to sqllock_runs that changes nothing first, to find out Group Replication), and
// raises the counter with sqllock_rowlock's epoch row (key of 32 zero bytes, empty
// name, a row no name has): an INSERT the first time ever, then a transaction that
// locks that row and REPLACEs it only if it is below the epoch, so that sessions of
// the same new run raise it once.
//
// Interrupting a waiter whose ctx ended needs no pooled connection on PostgreSQL with
// pgx (cancel requests go out of band). On MySQL, KILL QUERY is sent from a pooled
// connection only if one is free at once; otherwise the waiter's connection is
// closed, and the server keeps the dead waiter queued until the bound of the ctx
// deadline (at most about a second past it) or, without a deadline, until it is
// granted the lock, which it then gives up at once.
package forupdate
