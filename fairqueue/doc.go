// Package fairqueue is a strictly first-in first-out lock built from a waiter table:
// the SQL form of ZooKeeper's ephemeral sequential nodes. NewSemaphore gives the
// same queue with n holders, a fair counting semaphore.
//
// # Tickets
//
// Acquire draws a ticket for the name from its dispenser (sqllock_queue, migration
// 0005) and inserts it into sqllock_ticket. The ticket is drawn and inserted in one
// transaction, and the dispenser row stays locked until it commits, so the next
// ticket of the name is drawn only after this one is visible: the order of tickets is
// the order in which they became visible (a bare sequence or AUTO_INCREMENT would not
// do: their values are handed out before commit, and a lower ticket could appear
// after a higher one was granted). The lowest live ticket holds the lock (the n
// lowest, for a semaphore). Grants therefore follow the order of Acquire calls, across
// processes, and the ticket is the fencing token: strictly increasing with every
// grant, across restarts (dispensers are never deleted). On PostgreSQL the draw moves
// the dispenser on; on MySQL, which writes one table per statement, the draw numbers
// the ticket past both the dispenser and the highest ticket of the name, and the
// dispenser is moved on only before the highest ticket is deleted (a release that
// leaves a higher ticket deletes without it).
//
// A ticket is live while its expiry, on the database clock, is in the future; its
// owner keeps it alive with the library's lease core while it waits and while it
// holds, so a waiter or holder that dies (SIGKILL, a killed session, a partition)
// stops blocking its successors once its ticket expires, and not before. Its
// successor deletes it before taking the lock (waiting for a Check its transaction
// may still hold), and the reaper removes the dead tickets nobody came for
// (NewSweeper). A waiter whose own ticket died (it could not renew it for a whole
// TTL) draws a new one at the back of the queue. The lease of a holder ends with
// ErrLost before its ticket expires on the server, as for the other strategies.
//
// # Waiting
//
// Each waiter watches only its predecessors (the one before it; the n before it for
// a semaphore): there is no thundering herd. On PostgreSQL the statement that draws
// the ticket also looks at its predecessors (with a snapshot of its own, taken after
// the draw: migration 0008's sqllock_fairqueue_look), and locks them FOR KEY SHARE,
// which conflicts only with their delete. The release statement deletes the ticket
// and, after the delete, names the ticket that it made a holder (the lowest one left,
// the n-th for a semaphore, when none below it is dead: sqllock_fairqueue_next) in
// its NOTIFY, hex(key):released:g<granted>. The Locker's one LISTEN connection wakes
// only the waiters that watch the released ticket, and the grantee holds the lock
// without a statement of its own (if its lease is still live on the client; the
// grant is real, the NOTIFY is delivered at the commit). A waiter woken otherwise
// looks again: a watcher that is not the grantee (a semaphore), a dead predecessor
// (a waiter also wakes at its predecessor's expiry: a dead owner releases nothing),
// a cancelled waiter's deleted ticket. A release sends its NOTIFY only when someone
// may wait for it (a ticket above it is left, and no fewer than the permits): a
// waiter that watches a ticket locked it in its look, so the release's delete waits
// for that look's commit and then sees the waiter.
//
// On MySQL, which has no notifications, a waiter of a lock (one permit) that finds
// the name contended waits in the server instead: it takes a turn (a pooled session
// pinned with a server-enforced idle bound, as the other strategies' lines: at most
// 16 per Locker and a quarter of its pool, none below 4 connections), whose session
// holds a GET_LOCK named after its ticket until its release (taken by the statement
// that draws the ticket, before the ticket is visible, once the Locker has seen the
// name contended), and its look first waits for the GET_LOCK of its nearest live
// predecessor. The release statement deletes the
// ticket and gives its GET_LOCK back once the row is locked; the successor's look, a
// locking read, then waits for the delete to commit and sees it: a hand-off is one
// statement of the successor's, with no poll. These GET_LOCKs are a waiting aid only:
// the tickets decide who holds the lock. A predecessor that holds no such lock (it was
// granted without waiting, had no turn, or its session was killed) is polled for: the
// waiter next in line looks every 5-10 ms, the others sleep until about their turn,
// from the time between grants they have seen. Semaphores of several permits wait
// that way too. A release in the same process wakes its successor at once. Apart from
// a turn's session, waiters hold no pooled connection while they wait; tickets are
// renewed through the pool while waiting.
// A cancelled or timed-out Acquire deletes its ticket before it returns, so its
// successor moves up; TryAcquire never leaves a ticket behind.
//
// # Cost
//
// On PostgreSQL an acquisition is one statement (draw the ticket and look at the
// predecessors) and a release one more, contended or not: with 8 processes
// contending for a name, 2.0-2.1 statements per acquisition measured (keep-alives
// and listeners included). One more when dead tickets are ahead (they are dropped
// first), one per wake-up that is not a grant (semaphores, expiries, and the first
// wait of a Locker, whose listener wakes its waiters once it listens), and one for
// the listener's probe NOTIFY when it starts. On MySQL an uncontended acquisition is
// three statements: the draw, which tells that no other ticket was there (no look
// is needed), then the dispenser moved on and the delete at the release. Contended:
// the draw that takes the ticket's GET_LOCK, the look that waits in the server, and
// the release, a delete that a higher ticket spares the dispenser's move: 3.0
// statements per acquisition with 8 processes contending for a name
// (BenchmarkContended: hand-off p50 0.3-0.6 ms, 4.5 ms when waiters polled). One
// more for a Locker's first wait, when it takes a session for the line, and one
// per poll for a waiter whose predecessor holds no GET_LOCK. A waiter whose ticket
// turns out to be the last one at its release costs two more: its delete, which
// spares the dispenser, finds no higher ticket, so the dispenser is moved past it
// and the ticket deleted. Tickets are renewed every keep-alive interval while
// waiting too. Measured with 8 processes (go test -run '^$' -bench
// 'Contended/mysql/waiters=8$' -benchtime Nx ./fairqueue/, MariaDB 10.11): 3.039,
// 3.019 and 3.011 statements per acquisition for N = 1000, 3000 and 12000, which
// fits about 30 statements once (each Locker's first contended acquisition: a draw
// and a look through the pool, then the line's session set up) and 0.008 per
// acquisition (last tickets, polls).
//
// # Failover
//
// Tickets are as durable as the database: a failover to an asynchronous replica
// that missed the last commits can lose tickets and hand a number out again.
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
// error 3101, is retried like a deadlock). GET_LOCKs are not: a waiter connected to
// another node than its predecessor's polls for it.
package fairqueue
