package optimistic

import (
	"fmt"

	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/wait"
)

// The SQL of both dialects. Every time is the database's: clock_timestamp() on
// PostgreSQL, UTC_TIMESTAMP(6) on MySQL (constant within a statement). The client
// sends only durations, in microseconds.

// channel is the PostgreSQL NOTIFY channel of releases; the payload is the hex key.
const channel = "sqllock_optimistic"

const (
	// read returns the row's version, owner and the holder's remaining time in µs
	// (<= 0 when free). A plain read: it takes no lock.
	readPostgres = `SELECT version, owner, floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint
FROM sqllock_optimistic WHERE lock_key = $1`
	readMySQL = `SELECT version, owner, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM sqllock_optimistic WHERE lock_key = ?`

	// create makes the row of a name on first use, free, in its own autocommit
	// statement (no gap lock or duplicate key error: an existing row is left alone).
	// Its version starts at the name's sqllock_fence counter (0 for a new name; the
	// last version of a row the reaper deleted), so that a row's version is never
	// below the counter: every acquisition then takes the next version from the row
	// alone (the compare-and-swap also takes GREATEST with the counter). $1 key,
	// $2 name; MySQL: key, name, key.
	createPostgres = `INSERT INTO sqllock_optimistic (lock_key, name, version, expires_at)
SELECT $1, $2, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = $1), 0), clock_timestamp()
ON CONFLICT (lock_key) DO NOTHING`
	createMySQL = `INSERT INTO sqllock_optimistic (lock_key, name, version, expires_at)
SELECT ?, ?, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = ?), 0), UTC_TIMESTAMP(6)
ON DUPLICATE KEY UPDATE lock_key = lock_key`

	// mark records on PostgreSQL that an Acquire waits for the held row without the
	// server-side line, so that the release notifies (migration 0009); a takeover
	// clears it. $1 key.
	markPostgres = `UPDATE sqllock_optimistic SET waiters = true
WHERE lock_key = $1 AND NOT waiters AND holds > 0 AND expires_at > clock_timestamp()`

	// acquire is the compare-and-swap: it takes the row only if its version is the
	// one read and it is free (or expired) by the database clock, and increments the
	// version, the new fencing token. The version continues from the name's
	// sqllock_fence counter if that is higher (a row the reaper deleted and that was
	// created again). On MySQL LAST_INSERT_ID(v) makes the new version the insert id
	// of the statement's reply.
	//
	// $1 key, $2 version read, $3 owner, $4 TTL µs, $5 host, $6 pid.
	acquirePostgres = `UPDATE sqllock_optimistic o SET
  version = GREATEST(o.version, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = $1), 0)) + 1,
  owner = $3, holds = 1, acquired_at = n.t, expires_at = n.t + $4::bigint * interval '1 microsecond', host = $5, pid = $6,
  waiters = false
FROM (SELECT clock_timestamp() AS t) n
WHERE o.lock_key = $1 AND o.version = $2 AND o.expires_at <= n.t
RETURNING o.version`
	// ? owner, TTL µs, host, pid, key, key, version.
	acquireMySQL = `UPDATE sqllock_optimistic SET
  owner = ?, holds = 1, acquired_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, host = ?, pid = ?,
  version = LAST_INSERT_ID(GREATEST(version, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = ?), 0)) + 1)
WHERE lock_key = ? AND version = ? AND expires_at <= UTC_TIMESTAMP(6)`

	// reenter adds a hold to a live row of the same (reentrant) owner, or adopts a
	// live row of the same acquisition (whose reply was lost), returning its version.
	// $1 key, $2 owner, $3 TTL µs, $4 add a hold.
	reenterPostgres = `UPDATE sqllock_optimistic SET holds = holds + CASE WHEN $4::boolean THEN 1 ELSE 0 END,
  expires_at = GREATEST(expires_at, clock_timestamp() + $3::bigint * interval '1 microsecond')
WHERE lock_key = $1 AND owner = $2 AND expires_at > clock_timestamp()
RETURNING version`
	// ? add a hold, TTL µs, key, owner.
	reenterMySQL = `UPDATE sqllock_optimistic SET holds = holds + IF(?, 1, 0),
  expires_at = GREATEST(expires_at + INTERVAL 1 MICROSECOND, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND),
  version = LAST_INSERT_ID(version)
WHERE lock_key = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6)`

	// renew extends a live lease (expiry is final: an expired one is never revived).
	renewPostgres = `UPDATE sqllock_optimistic SET expires_at = GREATEST(expires_at, clock_timestamp() + $4::bigint * interval '1 microsecond')
WHERE lock_key = $1 AND version = $2 AND owner = $3 AND expires_at > clock_timestamp()`
	// GREATEST(expires_at + 1µs, ...) makes the row change, so that the affected row
	// count is 1 even within one microsecond (the driver reports changed rows).
	renewMySQL = `UPDATE sqllock_optimistic SET expires_at = GREATEST(expires_at + INTERVAL 1 MICROSECOND, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE lock_key = ? AND version = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6)`

	// release gives one hold back; the last one frees the row (owner cleared,
	// expires_at = now, the time it became free, holds 0).
	//
	// On PostgreSQL it notifies the waiters of a freed row, in the same statement,
	// only if someone waits: a waiter marked the row (markPostgres), or someone waits
	// in the key's server-side line (wait.Line; a waiter holds its lock while it
	// waits for a holder that did not come through the line). NOTIFY serialises the
	// commits of the whole database, so a release nobody waits for sends none. It
	// returns no row if the lease was not found, one if holds are left, two if the
	// row was freed and three if someone waits in line (the caller reads the row
	// count of an Exec).
	releasePostgresFmt = `WITH u AS (` + releaseUpdatePostgres + `  RETURNING lock_key, holds, waiters
), w AS (
  SELECT u.lock_key, u.holds, u.waiters, u.holds = 0 AND NOT pg_try_advisory_xact_lock_shared(` + "%[1]s" + `) AS in_line FROM u
)
SELECT CASE WHEN (w.in_line OR w.waiters) AND w.holds = 0 AND g = 1 THEN pg_notify('` + channel + `', encode(w.lock_key, 'hex')) END
FROM w CROSS JOIN generate_series(1, CASE WHEN w.in_line THEN 3 WHEN w.holds = 0 THEN 2 ELSE 1 END) g`
	// releaseMySQLFmt: its insert id is 2 * the holds left +
	// whether someone holds the key's line lock (%[1]s: its name, wait.Line.MyName).
	releaseMySQLFmt = releaseUpdateMySQL + `  holds = LAST_INSERT_ID(2 * GREATEST(holds - 1, 0) + (IS_USED_LOCK(%[1]s) IS NOT NULL)) DIV 2
WHERE lock_key = ? AND version = ? AND owner = ?`

	// releaseLinePostgres is the release of a lease that came through the line, on
	// its turn's session (holds 1): it frees the row, notifies the waiters if another
	// session took the line lock (a waiter in line; wait.PgRelease gives it back
	// first) or a waiter marked the row, and answers in one row: rows freed, then
	// unlocked and in_line.
	releaseLinePostgresFmt = `WITH u AS (` + releaseUpdatePostgres + `  RETURNING lock_key, waiters
), r AS (
  SELECT c.n, c.w, ` + "%[1]s" + ` FROM (SELECT count(*) AS n, COALESCE(bool_or(waiters), false) AS w FROM u) c
)
SELECT r.n, r.unlocked, r.in_line, CASE WHEN (r.in_line OR r.w) AND r.n > 0 THEN pg_notify('` + channel + `', encode($1::bytea, 'hex')) END FROM r`
	// releaseLineMySQL is that on MySQL (text: %[1]s key, %[2]d version, %[3]s
	// owner, %[4]s wait.Line.MyRelease): the line lock is given back in the
	// assignment, once the row is locked, before it commits; the insert id is 8 *
	// the holds left + MyRelease's value, or 0 if the lease's row was not found.
	releaseLineMySQL = releaseUpdateMySQL + `  holds = LAST_INSERT_ID(8 * GREATEST(holds - 1, 0) + %[4]s) DIV 8
WHERE lock_key = %[1]s AND version = %[2]d AND owner = %[3]s`

	// acquireLinePostgres is an attempt on a turn's session that first enters the
	// key's server-side line (wait.Line): q takes the line lock, waiting for it at
	// most $7 ms, and sets the session's bound ($8 ms); the time is read once the
	// lock is held. The statement's snapshot predates that wait, so the row is taken
	// with INSERT ... ON CONFLICT DO UPDATE, which locks and reads the current row:
	// free (released or expired by the database clock) means taken, with the next
	// version (a row's version is never below the name's sqllock_fence counter: see
	// createPostgres). A row the reaper deleted meanwhile is inserted, with the
	// version after the name's sqllock_fence counter as the snapshot saw it: the
	// answer's inserted column asks the caller to check that counter again
	// (fixVersion), which a new statement sees as it is. It answers one row: the
	// version (NULL if the lock is held), inserted, and whether the entry had to wait
	// (NULL when the session is not the client's own, $9: wait.PgEnter; nothing was
	// done then). A lock timeout error (55P03) means that the wait ran out and
	// nothing was done.
	//
	// $1 key, $2 name, $3 owner, $4 TTL µs, $5 host, $6 pid, $9 the backend pid pgx
	// saw.
	acquireLinePostgresFmt = `WITH q AS MATERIALIZED (
  SELECT ` + "%[1]s" + ` AS waited, ` + "%[2]s" + ` AS bound
), n AS MATERIALIZED (
  SELECT clock_timestamp() AS t FROM q WHERE q.waited IS NOT NULL
), u AS (
  INSERT INTO sqllock_optimistic AS o (lock_key, name, version, owner, holds, acquired_at, expires_at, host, pid)
  SELECT $1, $2, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = $1), 0) + 1, $3, 1, n.t, n.t + $4::bigint * interval '1 microsecond', $5, $6
  FROM n
  ON CONFLICT (lock_key) DO UPDATE SET
    version = GREATEST(o.version, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = $1), 0)) + 1,
    owner = excluded.owner, holds = 1, acquired_at = excluded.acquired_at, expires_at = excluded.expires_at,
    host = excluded.host, pid = excluded.pid, waiters = false
  WHERE o.holds = 0 OR o.expires_at <= excluded.acquired_at
  RETURNING o.version, xmax = 0 AS inserted
)
SELECT u.version, COALESCE(u.inserted, false), q.waited FROM q LEFT JOIN u ON true`
	// fixVersion raises the version of a row that acquireLinePostgres inserted past
	// the name's sqllock_fence counter, read now. $1 key, $2 owner, $3 version.
	fixVersionPostgres = `UPDATE sqllock_optimistic SET version = GREATEST(version, (SELECT f.token FROM sqllock_fence f WHERE f.lock_key = $1) + 1)
WHERE lock_key = $1 AND owner = $2 AND version = $3 RETURNING version`
	// acquireLineMySQL is that on MySQL (text: %[1]s the entry, wait.MyEnter; %[2]s
	// key, %[3]s owner, %[4]d TTL µs, %[5]s host, %[6]d pid): the derived table q is
	// materialised, so the line entered, before the row is read and locked (InnoDB
	// reads the current row, whatever the statement's start). A row released (holds
	// 0) or expired is taken with the next version, the insert id. No row changed:
	// the wait ran out, the lock is held, or the row is missing (the caller asks).
	// The counter's read names the entry, so that it runs once the line lock is held,
	// not while the entry waits (MariaDB evaluates an uncorrelated subquery first).
	acquireLineMySQL = `UPDATE sqllock_optimistic o JOIN %[1]s q SET
  o.owner = %[3]s, o.holds = 1, o.acquired_at = UTC_TIMESTAMP(6), o.expires_at = UTC_TIMESTAMP(6) + INTERVAL %[4]d MICROSECOND,
  o.host = %[5]s, o.pid = %[6]d,
  o.version = LAST_INSERT_ID(GREATEST(o.version, COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = %[2]s AND q.waited IS NOT NULL), 0)) + 1)
WHERE o.lock_key = %[2]s AND (o.holds = 0 OR o.expires_at <= UTC_TIMESTAMP(6))`

	// forget frees the row of an acquisition whose outcome the caller never learnt
	// and that it gave up (owners are unique per acquisition).
	forgetPostgres = `WITH u AS (
  UPDATE sqllock_optimistic SET holds = 0, owner = ''::bytea, expires_at = clock_timestamp()
  WHERE lock_key = $1 AND owner = $2 AND ` + rowlease.AsyncRelease + ` RETURNING lock_key
)
SELECT count(*), string_agg(pg_notify('` + channel + `', encode(lock_key, 'hex'))::text, '') FROM u`
	forgetMySQL = `UPDATE sqllock_optimistic SET holds = 0, owner = '', expires_at = UTC_TIMESTAMP(6) WHERE lock_key = ? AND owner = ?`
	// forgetProbeMySQL looks for that row without locking it (see wait.Forget).
	forgetProbeMySQL = `SELECT 1 FROM sqllock_optimistic WHERE lock_key = ? AND owner = ?`

	// check is the fencing check, run as the last statement of the caller's
	// transaction: the row must still be this lease's (version and owner) and
	// unexpired, and a share lock keeps it so until the transaction ends.
	checkPostgres = `SELECT 1 FROM sqllock_optimistic WHERE lock_key = $1 AND version = $2 AND owner = $3 AND expires_at > clock_timestamp() FOR SHARE`
	checkMySQL    = `SELECT 1 FROM sqllock_optimistic WHERE lock_key = ? AND version = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6) LOCK IN SHARE MODE`

	// sweepPostgres deletes at most $2 rows free for more than $1 µs, oldest first,
	// after raising their names' sqllock_fence counters to their versions, so that a
	// row created again continues from there. Candidates are locked FOR UPDATE SKIP
	// LOCKED (a row being acquired is skipped, never waited for) in a materialised
	// CTE; the DELETE re-checks them. It returns candidates and deleted rows.
	sweepPostgres = `WITH c AS MATERIALIZED (
  SELECT lock_key, name, version FROM sqllock_optimistic
  WHERE expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED
), f AS (
  INSERT INTO sqllock_fence AS f (lock_key, name, token)
  SELECT lock_key, name, version FROM c WHERE version > 0
  ON CONFLICT (lock_key) DO UPDATE SET token = GREATEST(f.token, excluded.token)
  RETURNING 1
), d AS (
  DELETE FROM sqllock_optimistic o USING c
  WHERE o.lock_key = c.lock_key AND o.version = c.version
    AND o.expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  RETURNING 1
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM d), (SELECT count(*) FROM f)`
)

// holder reads the row of a key if it is held (Locker.Holder): host, pid, version
// (the token), the grant time in µs since the epoch and the remaining time in µs,
// database clock. A free row's expires_at is in the past. A plain read: it takes no
// lock. MySQL's DATETIME(6) columns hold UTC.
const (
	holderPostgres = `SELECT host, pid, version, floor(extract(epoch FROM acquired_at) * 1000000)::bigint,
  floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint
FROM sqllock_optimistic WHERE lock_key = $1 AND holds > 0 AND expires_at > clock_timestamp()`
	holderMySQL = `SELECT host, pid, version, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', acquired_at),
  TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM sqllock_optimistic WHERE lock_key = ? AND holds > 0 AND expires_at > UTC_TIMESTAMP(6)`
)

// The statements that depend on the line's SQL.
var (
	releaseMySQL        = fmt.Sprintf(releaseMySQLFmt, wait.MyLineName("optimistic", "?"))
	releasePostgres     = fmt.Sprintf(releasePostgresFmt, wait.PgLineKey("optimistic", "$1"))
	releaseLinePostgres = fmt.Sprintf(releaseLinePostgresFmt, wait.PgRelease(wait.PgLineKey("optimistic", "$1")))
	acquireLinePostgres = fmt.Sprintf(acquireLinePostgresFmt, wait.PgEnter(wait.PgLineKey("optimistic", "$1"), "$7", "$9"), wait.PgBound("$8", "$9"))
)

// The update every release of both forms starts with (one hold less; the row freed
// when none is left), on PostgreSQL ($1 key, $2 version, $3 owner; RETURNING follows)
// and on MySQL (the holds assignment and the WHERE clause follow: MySQL runs the
// assignments left to right, so owner and expires_at read the holds before the
// update).
const (
	releaseUpdatePostgres = `
  UPDATE sqllock_optimistic SET holds = GREATEST(holds - 1, 0),
    owner = CASE WHEN holds <= 1 THEN ''::bytea ELSE owner END,
    expires_at = CASE WHEN holds <= 1 THEN clock_timestamp() ELSE expires_at END
  WHERE lock_key = $1 AND version = $2 AND owner = $3 AND ` + rowlease.AsyncRelease + `
`
	releaseUpdateMySQL = `UPDATE sqllock_optimistic SET
  owner = IF(holds <= 1, '', owner),
  expires_at = IF(holds <= 1, UTC_TIMESTAMP(6), expires_at),
`
)
