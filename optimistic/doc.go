// Package optimistic is the version-column strategy: a lock whose row carries a
// version that every acquisition increments with a compare-and-swap, and the same
// compare-and-swap for the caller's own versioned rows (Swap, Retry, ErrConflict).
//
// # The lock
//
// Each name has one row in sqllock_optimistic (migration 0004), keyed by SHA-256 of
// the name with the original bytes kept for operators: version, owner, hold count
// and an expiry on the database clock. Acquiring reads the row (creating it, free,
// on first use, in an autocommit statement of its own: no gap lock, no duplicate key
// error) and then takes it with one compare-and-swap:
//
//	UPDATE sqllock_optimistic SET version = version + 1, owner = ?, expires_at = <now + TTL>
//	WHERE lock_key = ? AND version = <read> AND expires_at <= <now>
//
// One row changed means acquired, and the new version is Lease.Token. A Locker
// remembers the version it last released for a name and tries the swap with it
// first, so that a name used again by the same Locker costs one statement to acquire
// and one to release. Waiting, the keep-alive, loss detection, reentrancy
// (sqllock.WithOwner, within the Locker), give-back on cancel and Check behave as in
// the uniqueindex package: see its documentation, which this package shares through
// the library's lease core.
//
// # Tokens
//
// The version only grows: acquisitions increment it, releases keep it, and the row
// is not deleted while the name is in use, so no fence table is needed for the
// tokens of a live name. The reaper may delete rows of names that have been free for
// longer than its grace period (NewSweeper): it first raises the name's counter in
// sqllock_fence to the row's version, and an acquisition of a re-created row
// continues from that counter. Tokens therefore keep increasing across
// acquisitions, takeovers of expired leases, sweeps and database restarts.
//
// # Contention
//
// Every waiter of one Locker queues in the process. Across processes, an Acquire
// that finds the lock held waits in the name's server-side line, as uniqueindex's
// do (see its documentation): one statement enters the line and, once its turn
// comes, takes the row if it is free (an INSERT ... ON CONFLICT DO UPDATE on
// PostgreSQL, which sees the current row whatever the statement's start; an UPDATE
// on MySQL), and the release gives the line lock back. Contended acquisitions are
// granted in FIFO order across processes at two statements each. On PostgreSQL a
// release sends a NOTIFY only if someone waits in the line. Without the line
// (TryAcquire, reentrant acquisitions, a line that is off or full) a waiter rereads
// and retries the swap after a wake-up (PostgreSQL NOTIFY) or a jittered backoff
// (MySQL). The article this strategy comes from warns that many conflicting writers
// burn round trips on failed swaps: for a single hot row of your own, forupdate
// serialises them in the database instead (see the README's measurements).
//
// # Failover
//
// Leases and versions are as durable as the database: a failover to an asynchronous
// replica that missed the last commits can forget a lease or hand a version out
// again.
//
// The Locker checks it before its first acquisition: on a PostgreSQL primary whose
// standbys replicate asynchronously, and on a MySQL source whose replicas do (no
// lossless semi-synchronous replication in force), it logs one warning, or refuses
// with sqllock.ErrUnsafeDeployment under WithRequireSyncReplication. With a synchronous
// standby a failover keeps leases and tokens (the ha suite kills the primary and
// promotes the standby). An attempt the caller gave up on whose commit the server
// finishes later (waiting for a synchronous standby that is away) deletes its row
// once the server answers: no lease of an exited caller stays live. On a Galera
// cluster, and in a MySQL Group Replication group (multi-primary too), the lease
// row is certified cluster-wide: safe from any node (a certification conflict,
// error 3101, is retried like a deadlock).
package optimistic
