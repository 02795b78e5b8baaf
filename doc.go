// Package sqllock defines the vocabulary shared by every lock strategy of this module:
// the Locker and Lease interfaces, Do, leader election (Campaign, Leader), the Dialect
// of the database, the name rules and the sentinel errors.
//
// A lock strategy lives in its own package and needs nothing but the SQL database a
// service already runs (PostgreSQL, or MySQL/MariaDB):
//
//   - uniqueindex: a lease row under a unique key (owner, expiry, fencing token, keep-alive)
//   - forupdate: a row lock held by an open transaction (SELECT ... FOR UPDATE)
//   - optimistic: compare-and-swap on a version column (the version is the token)
//   - fairqueue: a first-in first-out waiter table, and a fair counting semaphore
//   - advisory: pg_advisory_lock and GET_LOCK on a pinned session
//
// Every strategy honours the same semantics, through one lease core:
//
//   - Mutual exclusion: never two live holders of one name.
//   - Every lock has a server-enforced bound (a row's expiry on the database clock,
//     or an idle timeout the server applies to the session holding it), and the
//     holder's local deadline lies inside it: a holder that is cut off, frozen or
//     too slow is told (Done closes, Err reports ErrLost) before the server can
//     hand the lock to anyone else, and a dead holder's lock is free within seconds
//     (the TTL). The one exception is an operator's KILL of a session: the server
//     frees the lock at once, and the holder learns it within one keep-alive.
//   - Time is the database's: expiry is computed and compared on the database clock.
//   - Fencing: Lease.Token is strictly increasing per name across acquisitions.
//   - Loss is signalled: a lease that is no longer held closes Done and reports
//     ErrLost; Err and Done look at the local deadline themselves, so a holder resumed
//     after a pause learns of a loss at its first look.
//   - Names are exact: two names are the same lock if and only if their bytes are equal.
//   - Transient database errors (deadlocks, serialization failures, lock wait timeouts,
//     duplicate keys) during acquisition never reach the caller raw.
//   - Cancellation is clean: an Acquire whose context ends leaves nothing behind.
//
// Errors returned by this module match the sentinel errors with errors.Is, and carry
// the operation, dialect and lock name in an *Error.
package sqllock
