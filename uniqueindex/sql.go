package uniqueindex

import (
	"fmt"

	"github.com/sqllock/sqllock/internal/rowlease"
	"github.com/sqllock/sqllock/internal/wait"
)

// SQL of both dialects. Every time is the database's: clock_timestamp() on PostgreSQL
// (not now(), which is the start of the transaction), UTC_TIMESTAMP(6) on MySQL. The
// client only sends durations in microseconds.

// channel is the PostgreSQL notification channel a release notifies; the payload is
// the hex lock key.
const channel = "sqllock_lease"

const (
	// acquireMySQL is one attempt on MySQL, in one statement (%[1]s: nothing, or
	// the line's entry, see acquireLineMySQL). On MySQL a lease row is never deleted
	// while its name is in use: a release frees it in place (holds 0, owner empty,
	// expired), so its token is the last one granted for the name and a takeover
	// continues from it. A name without a row (first use, or swept by the reaper,
	// which first raises the name's sqllock_fence counter to the row's token)
	// continues from its sqllock_fence counter, read with a locking read (the latest
	// committed value, whatever the isolation level; a sweep that moves a token there
	// and deletes the row is waited for). So tokens increase across releases,
	// takeovers, sweeps and restarts without a second statement. The row is inserted,
	// or taken over if it has expired by the database clock (a released row has), or
	// re-entered by the same owner.
	//
	// A row is free when it was released (holds 0) or has expired by the database
	// clock (freeMySQL). UTC_TIMESTAMP(6) is constant within a statement, the time it
	// started: a row released while the statement waited (in the line, or for the
	// releasing statement's row lock) is free by its holds, not by its time. In ON
	// DUPLICATE KEY UPDATE the assignments run left to right and see the new values of
	// earlier columns, so holds and expires_at, which the conditions read, come last;
	// expires_at's own condition holds for a takeover both ways: by the new owner, or,
	// where the assignments all read the old row (MariaDB's sql_mode
	// SIMULTANEOUS_ASSIGNMENT), by the row being free. In the line's form (%[1]s, the
	// entry) the counter's read names the entry (%[3]s), so that it runs once the
	// line lock is held, not while the entry waits (MariaDB evaluates an uncorrelated
	// subquery first).
	//
	// The outcome is read from the insert id, never from the affected-rows count (which
	// depends on the client's clientFoundRows flag): both branches set it with
	// LAST_INSERT_ID(2*token + granted), so odd means granted (inserted, taken over
	// or re-entered) with token id/2, even means held by another owner, and 0 that
	// nothing ran (the line's wait ran out). A live row of the same owner is this
	// acquisition's own: a reentrant acquisition adds a hold, a retry after a lost
	// reply adopts it.
	//
	// The update clause names the new values with parameters, not VALUES(col), which
	// MySQL 8.0.20+ deprecates (1287) and MariaDB's alias form would not parse.
	//
	// ? key, name, owner, key, TTL µs, host, pid, then in the update clause:
	// owner, host, pid, owner, reentrant, owner, owner, TTL µs.
	acquireMySQLFmt = `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
SELECT ?, ?, ?, 1, LAST_INSERT_ID(2 * (COALESCE((SELECT f.token FROM sqllock_fence f WHERE f.lock_key = ?%[3]s LOCK IN SHARE MODE), 0) + 1) + 1) DIV 2,
  UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?%[1]s
ON DUPLICATE KEY UPDATE
  sqllock_lease.token       = LAST_INSERT_ID(2 * IF(%[2]s, sqllock_lease.token + 1, sqllock_lease.token)
                                + IF(%[2]s OR sqllock_lease.owner = ?, 1, 0)) DIV 2,
  sqllock_lease.acquired_at = IF(%[2]s, UTC_TIMESTAMP(6), sqllock_lease.acquired_at),
  sqllock_lease.host        = IF(%[2]s, ?, sqllock_lease.host),
  sqllock_lease.pid         = IF(%[2]s, ?, sqllock_lease.pid),
  sqllock_lease.owner       = IF(%[2]s, ?, sqllock_lease.owner),
  sqllock_lease.holds       = IF(%[2]s, 1, IF(? AND sqllock_lease.owner = ?, sqllock_lease.holds + 1, sqllock_lease.holds)),
  sqllock_lease.expires_at  = IF(%[2]s OR sqllock_lease.owner = ?,
                   GREATEST(sqllock_lease.expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), sqllock_lease.expires_at)`

	// takeFreeMySQL is the takeover branch of acquireMySQL alone, as an UPDATE by
	// the primary key: cheaper for the server than an INSERT that meets a duplicate
	// key. It changes the row only if it is free (freeMySQL), exactly as that branch
	// would, token included (the row's token plus one, returned as the insert id). It
	// changes no row if the row is held, re-entered by the same owner, or absent (never
	// used, or swept by the reaper); the full statement then runs. A Locker sends it
	// first only for a key it was last granted (Locker.lastGranted), and not for a
	// reentrant acquisition (whose own live row it cannot take).
	//
	// ? host, pid, owner, TTL µs, key.
	takeFreeMySQL = `UPDATE sqllock_lease SET token = LAST_INSERT_ID(token + 1), acquired_at = UTC_TIMESTAMP(6), host = ?, pid = ?, owner = ?, holds = 1,
  expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE lock_key = ? AND ` + freeMySQL

	// renew extends the lease if the row is still this lease's (key, owner, token)
	// and has not expired: expiry is final, an expired lease is never revived (it may
	// have been taken over and given back meanwhile, or be about to be).
	renewPostgres = `UPDATE sqllock_lease SET expires_at = GREATEST(expires_at, clock_timestamp() + $4::bigint * interval '1 microsecond')
WHERE lock_key = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp()`
	// GREATEST(expires_at + 1µs, ...) makes the row change, so that affected rows is 1
	// even within one microsecond (the MySQL driver reports changed rows).
	renewMySQL = `UPDATE sqllock_lease SET expires_at = GREATEST(expires_at + INTERVAL 1 MICROSECOND, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE lock_key = ? AND owner = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`

	// release frees the lease of the last hold. On PostgreSQL it deletes the row and
	// notifies waiters in the same statement (delivered at commit) if an Acquire
	// marked the row waited for; it returns one row per deleted row, and a second
	// one for a row that was waited for. On MySQL it frees the row in place (see
	// acquireMySQL) and its insert id tells whether the line lock of the key (%[1]s:
	// its name, wait.Line.MyName) is held by someone (1): someone waits in line.
	releasePostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND holds <= 1
  AND ` + rowlease.AsyncRelease + ` RETURNING lock_key, waiters)
SELECT CASE WHEN waiters AND g = 1 THEN pg_notify('` + channel + `', encode(lock_key, 'hex'))::text END
FROM d CROSS JOIN generate_series(1, CASE WHEN waiters THEN 2 ELSE 1 END) g`
	// ? key (the line's), key, owner, token.
	releaseMySQLFmt = `UPDATE sqllock_lease SET holds = 0 * LAST_INSERT_ID(IS_USED_LOCK(%[1]s) IS NOT NULL), owner = '',
  expires_at = LEAST(expires_at, UTC_TIMESTAMP(6))
WHERE lock_key = ? AND owner = ? AND token = ? AND holds <= 1`

	// releaseLineMySQL is the release on a turn's session (text: %[1]s key, %[2]s
	// owner, %[3]d token, %[4]s wait.Line.MyRelease): the line lock is given back in
	// the assignment, so once the row is locked, before it commits (the next waiter's
	// attempt waits for that commit); the insert id is MyRelease's value, or 0 if the
	// lease's row was not found (its line lock is then still held).
	releaseLineMySQL = `UPDATE sqllock_lease SET holds = 0 * LAST_INSERT_ID(%[4]s), owner = '',
  expires_at = LEAST(expires_at, UTC_TIMESTAMP(6))
WHERE lock_key = %[1]s AND owner = %[2]s AND token = %[3]d AND holds <= 1`

	// forget deletes the row of an acquisition whose outcome the caller never learnt
	// and that it gave up (owners are unique per acquisition).
	forgetPostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND ` + rowlease.AsyncRelease + ` RETURNING lock_key)
SELECT count(*), string_agg(pg_notify('` + channel + `', encode(lock_key, 'hex'))::text, '') FROM d`
	// On MySQL the row is freed in place (see acquireMySQL).
	forgetMySQL = `UPDATE sqllock_lease SET holds = 0, owner = '', expires_at = LEAST(expires_at, UTC_TIMESTAMP(6))
WHERE lock_key = ? AND owner = ?`
	// The statements of ForceRelease. revokedOwner is the owner a revoked row gets:
	// no acquisition has it (theirs start with 'L' or 'K'), so the holder's renewals,
	// Check and Release find its row gone. Each statement changes only a live lease's
	// row.
	revokePostgres = `UPDATE sqllock_lease SET owner = $1 WHERE lock_key = $2 AND owner <> $1 AND expires_at > clock_timestamp()`
	revokeMySQL    = `UPDATE sqllock_lease SET owner = ? WHERE lock_key = ? AND owner <> ? AND expires_at > UTC_TIMESTAMP(6)`
	// Now, PostgreSQL deletes the row and wakes the waiters as a release does; MySQL,
	// whose row keeps the name's last token, frees it in place as a release does.
	revokeNowPostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND expires_at > clock_timestamp() RETURNING lock_key)
SELECT count(*) FROM (SELECT pg_notify('` + channel + `', encode(lock_key, 'hex')) FROM d) x`
	revokeNowMySQL = `UPDATE sqllock_lease SET holds = 0, owner = ?, expires_at = LEAST(expires_at, UTC_TIMESTAMP(6))
WHERE lock_key = ? AND holds > 0 AND expires_at > UTC_TIMESTAMP(6)`
	revokedOwner = "R"
	// forgetProbeMySQL looks for that row without locking it (see Locker.forget).
	forgetProbeMySQL = `SELECT 1 FROM sqllock_lease WHERE lock_key = ? AND owner = ?`

	// unhold gives one hold of a reentrant lease back in one UPDATE, so that a
	// concurrent re-entry by the same owner is counted either before or after it,
	// never between two statements (an UPDATE that waits for a concurrent one re-reads
	// the row). The last hold (holds = 1; holds > 0 is a CHECK on PostgreSQL) is given
	// back by making the row expired: it is then free for the next acquirer, whose
	// takeover starts a new token; on PostgreSQL unholdDone deletes it, best effort
	// (the reaper otherwise), on MySQL it stays, freed (see acquireMySQL). PostgreSQL
	// returns rows, rows freed, and notifies the waiters of a freed row that was
	// waited for; MySQL returns the hold count before the update as the insert id
	// (LAST_INSERT_ID(holds)), and its assignments run left to right, so expires_at
	// and owner read the count before holds is updated.
	unholdPostgres = `WITH u AS (
  UPDATE sqllock_lease SET holds = GREATEST(holds - 1, 1),
    expires_at = CASE WHEN holds <= 1 THEN LEAST(expires_at, clock_timestamp() - interval '1 second') ELSE expires_at END
  WHERE lock_key = $1 AND owner = $2 AND token = $3
  RETURNING lock_key, waiters, expires_at <= clock_timestamp() AS freed
)
SELECT count(*), count(*) FILTER (WHERE freed),
  string_agg(CASE WHEN freed AND waiters THEN pg_notify('` + channel + `', encode(lock_key, 'hex'))::text END, '') FROM u`
	unholdMySQL = `UPDATE sqllock_lease SET
  expires_at = IF(holds <= 1, LEAST(expires_at, UTC_TIMESTAMP(6) - INTERVAL 1 SECOND), expires_at),
  owner = IF(holds <= 1, '', owner),
  holds = GREATEST(LAST_INSERT_ID(holds) - 1, 0)
WHERE lock_key = ? AND owner = ? AND token = ?`
	unholdDonePostgres = `DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND expires_at <= clock_timestamp()`

	// check is the fencing check, run in the caller's transaction: the row must still
	// be this lease's and unexpired, and a share lock keeps it so (no renewal, release
	// or takeover can change it) until that transaction ends.
	checkPostgres = `SELECT 1 FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp() FOR SHARE`
	checkMySQL    = `SELECT 1 FROM sqllock_lease WHERE lock_key = ? AND owner = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6) LOCK IN SHARE MODE`

	// sweepPostgres deletes at most $2 rows that expired more than $1 µs ago, oldest
	// first, and returns how many candidates it locked and how many it deleted. The
	// candidates are locked FOR UPDATE SKIP LOCKED in a materialised CTE (evaluated
	// once, so a batch never exceeds $2): reapers on every node take disjoint batches,
	// and a row that a Release, renewal or takeover has locked is skipped, not waited
	// for. The reaper therefore never waits for a lock and cannot be part of a
	// deadlock; an acquirer taking over an expired row that a batch holds waits at
	// most for that one short statement. The DELETE re-checks expiry on the locked
	// rows. PostgreSQL has no gap locks: nothing but the candidates is locked.
	sweepPostgres = `WITH c AS MATERIALIZED (
  SELECT lock_key FROM sqllock_lease WHERE expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED
), d AS (
  DELETE FROM sqllock_lease l USING c
  WHERE l.lock_key = c.lock_key AND l.expires_at < clock_timestamp() - $1::bigint * interval '1 microsecond'
  RETURNING 1
)
SELECT (SELECT count(*) FROM c), (SELECT count(*) FROM d)`
)

// holder reads the live lease row of a key (Locker.Holder): host, pid, token, the
// grant time in µs since the epoch and the remaining time in µs, database clock. A
// plain read: it takes no lock. MySQL's DATETIME(6) columns hold UTC.
const (
	holderPostgres = `SELECT host, pid, token, floor(extract(epoch FROM acquired_at) * 1000000)::bigint,
  floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000)::bigint
FROM sqllock_lease WHERE lock_key = $1 AND expires_at > clock_timestamp()`
	holderMySQL = `SELECT host, pid, token, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', acquired_at),
  TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)
FROM sqllock_lease WHERE lock_key = ? AND expires_at > UTC_TIMESTAMP(6)`
)

// acquirePostgres is one attempt (see acquirePg); acquireLinePostgres is the same on
// a turn's session that first enters the server-side line (wait.Line): the CTE q
// takes the line lock, waiting for it at most $9 ms, and sets the session's bound
// ($10 ms); the fence increment reads q, so everything else runs once the line lock
// is held. The statement's snapshot predates that wait, but nothing decides on it:
// ON CONFLICT locks and reads the current row (and a row deleted meanwhile is no
// conflict); only the waiter's hint reads the snapshot. It answers one row, whose
// fourth column says whether the entry had to wait, or is NULL if the session is not
// the client's own ($11, wait.PgEnter): nothing was done then. A lock timeout error
// (55P03) means that the wait ran out and nothing was done.
var (
	// releaseLinePostgres is releasePostgres on a turn's session, which also gives the
	// line lock back (wait.PgRelease) once the row is deleted: one row, the rows
	// deleted, the notification, then unlocked and in_line.
	releaseLinePostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND holds <= 1
  AND ` + rowlease.AsyncRelease + ` RETURNING lock_key, waiters)
SELECT c.n, c.notified, ` + wait.PgRelease(wait.PgLineKey("uniqueindex", "$1")) + `
FROM (SELECT count(*) AS n, string_agg(CASE WHEN waiters THEN pg_notify('` + channel + `', encode(lock_key, 'hex'))::text END, '') AS notified FROM d) c`
	acquireMySQL        = fmt.Sprintf(acquireMySQLFmt, "", freeMySQL, "")
	releaseMySQL        = fmt.Sprintf(releaseMySQLFmt, wait.MyLineName("uniqueindex", "?"))
	acquirePostgres     = acquirePg("", "VALUES ($1, $2, 1)", false)
	acquireLinePostgres = acquirePg("q AS MATERIALIZED (SELECT "+wait.PgEnter(wait.PgLineKey("uniqueindex", "$1"), "$9", "$11")+
		" AS waited, "+wait.PgBound("$10", "$11")+" AS bound), ", "SELECT $1, $2, 1 FROM q WHERE q.waited IS NOT NULL", true)
)

// freeMySQL is the condition of acquireMySQL under which the row is free.
const freeMySQL = "(sqllock_lease.holds = 0 OR sqllock_lease.expires_at <= UTC_TIMESTAMP(6))"

// acquirePg builds the PostgreSQL attempt: one statement. The CTE f increments the
// fencing counter of the name in sqllock_fence and keeps that row locked until the
// statement commits, so attempts on one name are serialised and the token order is
// the commit order. The lease row is inserted, or taken over if it has expired by
// the database clock, or re-entered ($5) by the same owner. A failed attempt
// returns the holder's remaining time in microseconds (a hint for the waiter).
// clock_timestamp() is read once (n.t, excluded.acquired_at): every branch compares
// the row's expiry with that one instant, so an attempt exactly at expiry cannot
// mix the takeover and reentry branches. A live row of the same owner is this
// acquisition's own (owners are unique per acquisition, or the reentrant key): a
// reentrant acquisition ($5) adds a hold, a retry after a lost reply adopts it.
// An attempt of an Acquire ($8) that finds the lease held by another owner marks
// it waited for, in the same ON CONFLICT update (which sees the latest row, not
// the statement's snapshot: a holder that released and re-acquired meanwhile has
// a new row, and that is the one to mark), changing nothing else, so that its
// release notifies; the update is skipped if the row is marked already, and a
// takeover clears the mark. The mark is written under the row lock the release's
// DELETE takes too: a release either sees it or comes first, and then the attempt
// finds no row to wait for. granted tells a grant from a mark.
//
// head is prepended to the WITH list, fence is the row source of the counter's
// insert; inLine makes the answer one row of four columns, the fourth the entry's
// (see acquireLinePostgres).
//
// $1 key, $2 name, $3 owner, $4 TTL µs, $5 reentrant, $6 host, $7 pid, $8 will wait.
func acquirePg(head, fence string, inLine bool) string {
	open, close := "", ""
	if inLine {
		open = "SELECT COALESCE(r.token, 0), COALESCE(r.holds, 0), COALESCE(r.rem, 0), q.waited FROM q LEFT JOIN (\n"
		close = "\n) r ON true"
	}
	return fmt.Sprintf(`WITH %[1]sf AS (
  INSERT INTO sqllock_fence AS f (lock_key, name, token) %[2]s
  ON CONFLICT (lock_key) DO UPDATE SET token = f.token + 1
  RETURNING token
), ins AS (
  INSERT INTO sqllock_lease AS l (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
  SELECT $1, $2, $3, 1, f.token, n.t, n.t + $4::bigint * interval '1 microsecond', $6, $7
    FROM f, LATERAL (SELECT clock_timestamp() AS t, f.token AS ft) n
  ON CONFLICT (lock_key) DO UPDATE SET
    holds       = CASE WHEN l.expires_at <= excluded.acquired_at THEN 1 WHEN l.owner <> excluded.owner THEN l.holds
                       WHEN $5::boolean THEN l.holds + 1 ELSE l.holds END,
    token       = CASE WHEN l.expires_at <= excluded.acquired_at THEN excluded.token ELSE l.token END,
    acquired_at = CASE WHEN l.expires_at <= excluded.acquired_at THEN excluded.acquired_at ELSE l.acquired_at END,
    owner       = CASE WHEN l.expires_at <= excluded.acquired_at OR l.owner = excluded.owner THEN excluded.owner ELSE l.owner END,
    host        = CASE WHEN l.expires_at <= excluded.acquired_at OR l.owner = excluded.owner THEN excluded.host ELSE l.host END,
    pid         = CASE WHEN l.expires_at <= excluded.acquired_at OR l.owner = excluded.owner THEN excluded.pid ELSE l.pid END,
    expires_at  = CASE WHEN l.expires_at <= excluded.acquired_at OR l.owner = excluded.owner
                       THEN GREATEST(l.expires_at, excluded.expires_at) ELSE l.expires_at END,
    waiters     = CASE WHEN l.expires_at <= excluded.acquired_at THEN false WHEN l.owner = excluded.owner THEN l.waiters ELSE true END
  WHERE l.expires_at <= excluded.acquired_at OR l.owner = excluded.owner OR ($8::boolean AND NOT l.waiters)
  RETURNING l.token, l.holds, l.owner = $3 AS granted, l.expires_at
)
%[3]sSELECT token, holds, 0::bigint AS rem FROM ins WHERE granted
UNION ALL
SELECT 0, 0, GREATEST(0, floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000))::bigint FROM ins WHERE NOT granted
UNION ALL
SELECT 0, 0, GREATEST(0, floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000))::bigint
  FROM sqllock_lease WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM ins)%[4]s`, head, fence, open, close)
}
