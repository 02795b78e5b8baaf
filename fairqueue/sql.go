package fairqueue

import (
	"fmt"
	"strconv"

	"github.com/sqllock/sqllock/internal/rowlease"
)

// The SQL of both dialects. Every time is the database's: clock_timestamp() on
// PostgreSQL, UTC_TIMESTAMP(6) on MySQL (constant within a statement).

// channel is the PostgreSQL NOTIFY channel. The payload is hex(key) + ":" + the
// released ticket, the event its successors wait for, followed by ":g" + the ticket
// that the release made a holder when the release statement can name it (see
// releasePostgresSQL): the event that ticket's waiter waits for (grantEvent).
const channel = "sqllock_fairqueue"

// lookPostgres is the look at the predecessors of ticket (an SQL expression) on
// PostgreSQL, with limit (an SQL expression) the permits: rows (ticket, remaining µs)
// of the nearest live tickets below it, locked FOR KEY SHARE, then (0, -1) if one
// below it is dead. The function is migration 0008's; see there why it is one.
func lookPostgres(ticket, limit string) string {
	return `SELECT pred, rem FROM sqllock_fairqueue_look($1, ` + ticket + `, ` + limit + `)`
}

// rowTicket marks the row of enqueuePostgres that carries the ticket drawn:
// (rowTicket, the ticket). The others are those of its look.
const rowTicket = -2

// enqueuePostgres draws the next ticket of the name and inserts it, in one
// statement, so in one transaction: the dispenser row stays locked until the ticket
// commits, and the next enqueue of the name waits for that commit. So the order of
// tickets is the order in which they became visible, and a waiter can never find a
// lower ticket appear after it looked.
//
// The same statement then looks at the predecessors of the new ticket
// (lookPostgres): the look's own snapshot, taken after the draw, sees every lower
// ticket, even those that committed after the statement's snapshot (when it waited
// for another enqueue of the name), and the look locks what it returns. An
// uncontended acquisition is this one statement.
//
// $1 key, $2 name, $3 owner, $4 TTL µs, $5 host, $6 pid, $7 permits.
var enqueuePostgres = `WITH q AS (
  INSERT INTO sqllock_queue AS q (lock_key, name, next_ticket) VALUES ($1, $2, 2)
  ON CONFLICT (lock_key) DO UPDATE SET next_ticket = q.next_ticket + 1
  RETURNING next_ticket - 1 AS ticket
), t AS (
  INSERT INTO sqllock_ticket (lock_key, ticket, owner, created_at, expires_at, host, pid)
  SELECT $1, q.ticket, $3, n.t, n.t + $4::bigint * interval '1 microsecond', $5, $6
  FROM q, (SELECT clock_timestamp() AS t) n
  RETURNING ticket
)
SELECT ` + strconv.Itoa(rowTicket) + `, ticket FROM t
UNION ALL
` + lookPostgres("(SELECT ticket FROM t)", "$7")

// predecessorsPostgres is the look of a statement of its own (a waiter woken without
// its grant). $1 key, $2 ticket, $3 permits.
var predecessorsPostgres = lookPostgres("$2", "$3")

// releasePostgresSQL returns the PostgreSQL statement that deletes the tickets of key
// $1 that match selects and tells their waiters, permits being the SQL of the
// permits. It returns one row per deleted ticket: the ticket, the ticket its delete
// made a holder (or NULL), and whether it sent a NOTIFY. What to tell is migration
// 0008's sqllock_fairqueue_next, called after the delete (see there): the grantee,
// whose waiter, which the NOTIFY reaches at the commit, goes in without a statement
// of its own if its lease is still live on the client; and whether a ticket above
// the deleted one is left: only then does the NOTIFY go out (a NOTIFY serialises the
// commits of the whole database).
func releasePostgresSQL(match, permits string) string {
	return `WITH d AS (
  DELETE FROM sqllock_ticket WHERE lock_key = $1 AND ` + match + ` AND ` + rowlease.AsyncRelease + `
  RETURNING lock_key, ticket
)
SELECT d.ticket, n.grantee, (CASE WHEN n.waited THEN
  pg_notify('` + channel + `', encode(d.lock_key, 'hex') || ':' || d.ticket::text || COALESCE(':g' || n.grantee::text, ''))::text
END) IS NOT NULL
FROM d, LATERAL sqllock_fairqueue_next($1, d.ticket, ` + permits + `) n`
}

const (
	// enqueueMySQL draws a ticket in one statement: it inserts the ticket numbered
	// past both the dispenser and the highest ticket of the name (its number is in
	// the statement's insert id, enqueueTicketMySQL). The dispenser row stays locked
	// until the statement commits: the next draw of the name waits for it, then reads the highest ticket,
	// so a number is drawn only once every lower ticket is visible, and tickets become
	// visible in their order (as on PostgreSQL; under REPEATABLE READ, MySQL's
	// default, an INSERT ... SELECT also reads the tickets with shared locks, which
	// wait for a ticket being inserted). A draw that meets a ticket of its number
	// anyway gets a duplicate key and draws in a transaction instead (drawTx); so no
	// number is drawn twice.
	//
	// The dispenser only remembers the numbers of deleted tickets: a ticket that may
	// be the highest of its name is deleted only after bumpMySQL moved the dispenser
	// past it (the release of the last ticket, a forget, the sweep). A release that
	// finds a higher ticket deletes without it (releaseAfterMySQL): the highest
	// ticket stays, and whoever deletes that one moves the dispenser first. So the
	// next number, the greater of the two, never goes down, and no number is granted
	// twice.
	//
	// ? key, owner, TTL µs, host, pid, key.
	enqueueMySQL = `INSERT INTO sqllock_ticket (lock_key, ticket, owner, created_at, expires_at, host, pid)
SELECT ?, ` + enqueueTicketMySQL + `,
  ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?
FROM sqllock_queue q WHERE q.lock_key = ? FOR UPDATE`
	// enqueueLineMySQLFmt is enqueueMySQL as text for a turn's session (%[1]s key,
	// %[2]s owner, %[3]d TTL µs, %[4]s host, %[5]d pid), which also takes the lock
	// of the ticket drawn (%[6]s: wait.MyTicketName of enqueueNumberMySQL) once the
	// dispenser row is locked (the condition reads its columns), before the ticket
	// commits: no successor can find the ticket without its lock held.
	enqueueLineMySQLFmt = `INSERT INTO sqllock_ticket (lock_key, ticket, owner, created_at, expires_at, host, pid)
SELECT q.lock_key, ` + enqueueTicketMySQL + `,
  %[2]s, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL %[3]d MICROSECOND, %[4]s, %[5]d
FROM sqllock_queue q WHERE q.lock_key = %[1]s AND GET_LOCK(%[6]s, 0) IS NOT NULL FOR UPDATE`
	// enqueueTicketMySQL is the ticket column of a draw: its number, and the insert
	// id 2 * the number + 1 if the name has no other ticket (the draw holds the lock
	// then: no look is needed), + 0 otherwise, in unsigned arithmetic (the insert id
	// is an unsigned 64-bit number: every ticket up to 2^63-1 fits). The SELECT of
	// an INSERT ... SELECT reading the table it inserts into is read whole before the
	// insert. Both reads of the name's tickets start from the highest: a read from the
	// lowest would lock (REPEATABLE READ) the deleted tickets not yet purged, hundreds
	// under load, and deadlock with the releases.
	enqueueTicketMySQL = `LAST_INSERT_ID(2 * CAST(` + enqueueNumberMySQL + ` AS UNSIGNED) + (` + highestMySQL + ` IS NULL)) DIV 2`
	// enqueueNumberMySQL is the number a draw takes (q: the dispenser's row).
	enqueueNumberMySQL = `GREATEST(q.next_ticket, COALESCE(` + highestMySQL + `, 0) + 1)`
	// highestMySQL is the highest ticket of the dispenser q's name, or NULL: read
	// from the name's top row down (see topMySQL).
	highestMySQL = `(SELECT MAX(t.ticket) FROM sqllock_ticket t WHERE t.lock_key = q.lock_key AND t.ticket < ` + topMySQL + `)`
	// bumpMySQLFmt moves the dispenser past a ticket (%[1]s ticket, %[2]s key: "?"
	// for bumpMySQL, values for a turn's session).
	bumpMySQLFmt = `UPDATE sqllock_queue SET next_ticket = GREATEST(next_ticket, %[1]s + 1) WHERE lock_key = %[2]s`
	// bumpOwnerMySQL moves the dispenser past the tickets of an owner (forget).
	// ? key, owner, key.
	bumpOwnerMySQL = `UPDATE sqllock_queue SET next_ticket = GREATEST(next_ticket,
  COALESCE((SELECT MAX(t.ticket) FROM sqllock_ticket t WHERE t.lock_key = ? AND t.owner = ?), 0) + 1) WHERE lock_key = ?`
	// The statements of drawTx: lock the dispenser, read the highest ticket.
	drawTxLockMySQL    = `SELECT next_ticket FROM sqllock_queue WHERE lock_key = ? FOR UPDATE`
	drawTxHighestMySQL = `SELECT COALESCE(MAX(ticket), 0) FROM sqllock_ticket WHERE lock_key = ? AND ticket < ` + topMySQL
	// ? key, ticket, owner, TTL µs, host, pid.
	drawTxTicketMySQL = `INSERT INTO sqllock_ticket (lock_key, ticket, owner, created_at, expires_at, host, pid)
VALUES (?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?)`
	// topMySQL is the ticket number of a MySQL name's top row: not a ticket (it has
	// no owner and expired in 1970: no look, holder or check sees it), it sits above
	// every ticket of its name in the primary key, so that the draw's reads of the
	// highest ticket, which lock (REPEATABLE READ) the row after the last one they
	// read, lock this row of their own name's, not the first ticket of the next name
	// in key order, which that name's release deletes: with many names in use at once,
	// draws and releases of neighbouring names deadlocked (858 deadlocks in a bench
	// run of 32 processes on names of their own, a release failing after its retries).
	// Every read of the highest ticket and the sweep leave it out. A Locker adds it
	// once per name it draws for (topRowMySQL); a name without one works as before.
	topMySQL = `9223372036854775807`
	// ? key.
	topRowMySQL = `INSERT INTO sqllock_ticket (lock_key, ticket, owner, created_at, expires_at, host, pid)
VALUES (?, ` + topMySQL + `, '', '1970-01-01 00:00:01', '1970-01-01 00:00:01', '', 0) ON DUPLICATE KEY UPDATE pid = 0`
	// createMySQL makes the dispenser of a name on first use.
	createMySQL = `INSERT INTO sqllock_queue (lock_key, name, next_ticket) VALUES (?, ?, 1)
ON DUPLICATE KEY UPDATE lock_key = lock_key`

	// predecessorsMySQL returns the n nearest live tickets below the ticket (ticket,
	// remaining µs), a row (-1, number of live tickets below it: the waiter's
	// position), and, if any ticket below it is dead (expired), a marker row (0, -1).
	// ? key, ticket, n, key, ticket, key, ticket.
	predecessorsMySQL = `SELECT ticket, rem FROM (
  SELECT ticket, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) AS rem
  FROM sqllock_ticket WHERE lock_key = ? AND ticket < ? AND expires_at > UTC_TIMESTAMP(6)
  ORDER BY ticket DESC LIMIT ?
) live
UNION ALL
SELECT -1, COUNT(*) FROM sqllock_ticket WHERE lock_key = ? AND ticket < ? AND expires_at > UTC_TIMESTAMP(6)
UNION ALL
SELECT 0, -1 FROM DUAL WHERE EXISTS (SELECT 1 FROM sqllock_ticket WHERE lock_key = ? AND ticket < ? AND expires_at <= UTC_TIMESTAMP(6))`

	// dropDead deletes the dead tickets below a waiter's before it takes the lock:
	// the delete waits for a Check share lock a dead holder's transaction may still
	// have on its row, so that no write fenced by that Check commits once the next
	// holder is in.
	dropDeadPostgres = `DELETE FROM sqllock_ticket WHERE lock_key = $1 AND ticket < $2 AND expires_at <= clock_timestamp()`
	dropDeadMySQL    = `DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket < ? AND expires_at <= UTC_TIMESTAMP(6)`

	// renew extends a live ticket (expiry is final: a dead ticket is never revived).
	renewPostgres = `UPDATE sqllock_ticket SET expires_at = GREATEST(expires_at, clock_timestamp() + $4::bigint * interval '1 microsecond')
WHERE lock_key = $1 AND ticket = $2 AND owner = $3 AND expires_at > clock_timestamp()`
	renewMySQL = `UPDATE sqllock_ticket SET expires_at = GREATEST(expires_at + INTERVAL 1 MICROSECOND, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE lock_key = ? AND ticket = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6)`

	// releaseMySQL deletes the ticket (see releasePostgresSQL for PostgreSQL), once
	// bumpMySQL moved the dispenser past it; releaseAfterMySQL deletes it only if a
	// higher ticket is left, without the bump (see enqueueMySQL). The highest
	// ticket's read is a derived table, which MySQL materialises (a subquery on the
	// table a DELETE deletes from is refused). ? key, ticket, owner (, key).
	releaseMySQL = `DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND owner = ?`
	// higherLeftMySQLFmt is releaseAfterMySQL's condition (%[1]s the key).
	higherLeftMySQLFmt = ` AND ticket < (SELECT m FROM (SELECT MAX(ticket) AS m FROM sqllock_ticket WHERE lock_key = %[1]s AND ticket < ` + topMySQL + `) x)`

	// The MySQL line of a lock (permits 1; see Locker.enterLine): text for a turn's
	// session, with the values in it (hexadecimal literals and numbers).
	//
	// lineLookMySQLFmt takes the waiter's ticket lock (%[1]s, wait.MyTicketName) if it
	// is free, waits for its predecessor's (%[2]s, wait.MyEnter of that name, %[5]s),
	// and then looks at the tickets below the waiter's (%[3]s key, %[4]d ticket), in
	// one row: the rows it joined (0 when the wait ran out: no look was made), the
	// nearest live ticket (0: none), how many are live and how many dead, and the
	// least time left of a live one (µs); and it gives the predecessor's lock back
	// (the entry takes it twice), as the row is sent, after the look: a waiter never
	// keeps another ticket's lock. The two derived tables have no table: they are read, in
	// their order, before the statement reads one, so no row lock is held while it
	// waits. The look is a locking read: a release that gave its ticket lock back
	// before its delete committed (releaseLineMySQLFmt) is waited for, and then seen.
	lineLookMySQLFmt = `SELECT COUNT(*), COALESCE(MAX(IF(t.expires_at > UTC_TIMESTAMP(6), t.ticket, NULL)), 0),
  COALESCE(SUM(t.expires_at > UTC_TIMESTAMP(6)), 0), COALESCE(SUM(t.expires_at <= UTC_TIMESTAMP(6)), 0),
  COALESCE(MIN(IF(t.expires_at > UTC_TIMESTAMP(6), TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), t.expires_at), NULL)), 0),
  COALESCE(RELEASE_LOCK(%[5]s), 0) + COALESCE(RELEASE_LOCK(%[5]s), 0)
FROM (SELECT GET_LOCK(%[1]s, 0) AS own) o, %[2]s e
LEFT JOIN sqllock_ticket t ON t.lock_key = %[3]s AND t.ticket < %[4]d LOCK IN SHARE MODE`
	// releaseLineMySQLFmt deletes the ticket (%[1]s key, %[2]d ticket, %[3]s owner)
	// on the session of the turn that holds its ticket lock, and gives the session's
	// locks back once the row is locked (the condition reads a column that only the
	// locked row gives: MySQL 9.7 evaluates one without a column of the row before
	// it locks the row), before the delete commits; they stay held if no row
	// matched. %[4]s: the condition of a release without the bump
	// (higherLeftMySQLFmt), or "" after the bump.
	releaseLineMySQLFmt = `DELETE FROM sqllock_ticket WHERE lock_key = %[1]s AND ticket = %[2]d AND owner = %[3]s%[4]s
  AND RELEASE_ALL_LOCKS() + LENGTH(created_at) > 0`

	// forgetMySQL deletes the tickets of an acquisition whose enqueue outcome the
	// caller never learnt and that it gave up (owners are unique per acquisition),
	// once bumpOwnerMySQL moved the dispenser past them.
	forgetMySQL = `DELETE FROM sqllock_ticket WHERE lock_key = ? AND owner = ?`

	// check is the fencing check, run as the last statement of the caller's
	// transaction: the ticket is still the lease's and live, and a share lock keeps
	// it (no successor can drop it) until the transaction ends.
	checkPostgres = `SELECT 1 FROM sqllock_ticket WHERE lock_key = $1 AND ticket = $2 AND owner = $3 AND expires_at > clock_timestamp() FOR SHARE`
	checkMySQL    = `SELECT 1 FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6) LOCK IN SHARE MODE`

	// sweepPostgres deletes at most $2 tickets dead for more than $1 µs, locked FOR
	// UPDATE SKIP LOCKED (a ticket share-locked by a Check, or being renewed, is
	// skipped, never waited for). It returns candidates and deleted rows.
	sweepPostgres = `WITH c AS MATERIALIZED (
  SELECT lock_key, ticket FROM sqllock_ticket WHERE expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED
), d AS (
  DELETE FROM sqllock_ticket t USING c
  WHERE t.lock_key = c.lock_key AND t.ticket = c.ticket
    AND t.expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  RETURNING 1
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM d)`
	// MySQL: candidates by a plain read, then deleted one by one by primary key,
	// re-checked (see uniqueindex's sweep for why no range is locked), each once
	// bumpMySQL moved the dispenser past it (see enqueueMySQL).
	sweepSelectMySQL = `SELECT lock_key, ticket FROM sqllock_ticket WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND ticket < ` + topMySQL + `
ORDER BY expires_at LIMIT ?`
	sweepDeleteMySQL = `DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND ticket < ` + topMySQL + ` AND expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND`
)

// holder reads the lowest live ticket of a key (Locker.Holder): host, pid, ticket
// (the token), the ticket's creation in µs since the epoch and its remaining time in
// µs, database clock. A plain read: it takes no lock. MySQL's DATETIME(6) columns
// hold UTC.
const (
	holderPostgres = `SELECT host, pid, ticket, floor(extract(epoch FROM created_at) * 1000000)::bigint,
  floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint
FROM sqllock_ticket WHERE lock_key = $1 AND expires_at > clock_timestamp() ORDER BY ticket LIMIT 1`
	holderMySQL = `SELECT host, pid, ticket, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at),
  TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM sqllock_ticket WHERE lock_key = ? AND expires_at > UTC_TIMESTAMP(6) ORDER BY ticket LIMIT 1`
)

// The release statements of PostgreSQL: by ticket ($1 key, $2 ticket, $3 owner, $4
// permits), and forget ($1 key, $2 owner, $3 permits): the tickets of an acquisition
// whose enqueue outcome the caller never learnt and that it gave up (owners are
// unique per acquisition).
var (
	releaseTicketPostgres = releasePostgresSQL("ticket = $2 AND owner = $3", "$4")
	forgetPostgres        = releasePostgresSQL("owner = $2", "$3")
)

// The MySQL statements made from the templates above, with "?" parameters.
var (
	bumpMySQL         = fmt.Sprintf(bumpMySQLFmt, "?", "?")                 // ? ticket, key
	releaseAfterMySQL = releaseMySQL + fmt.Sprintf(higherLeftMySQLFmt, "?") // ? key, ticket, owner, key
)
