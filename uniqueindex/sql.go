package uniqueindex

import "github.com/sqllock/sqllock/internal/rowlease"

// SQL of both dialects. Every time is the database's: clock_timestamp() on PostgreSQL
// (not now(), which is the start of the transaction), UTC_TIMESTAMP(6) on MySQL. The
// client only sends durations in microseconds.

// channel is the PostgreSQL notification channel a release notifies; the payload is
// the hex lock key.
const channel = "sqllock_lease"

const (
	// acquirePostgres is one attempt in one statement. The CTE f increments the
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
	// $1 key, $2 name, $3 owner, $4 TTL µs, $5 reentrant, $6 host, $7 pid, $8 will wait.
	acquirePostgres = `WITH f AS (
  INSERT INTO sqllock_fence AS f (lock_key, name, token) VALUES ($1, $2, 1)
  ON CONFLICT (lock_key) DO UPDATE SET token = f.token + 1
  RETURNING token
), ins AS (
  INSERT INTO sqllock_lease AS l (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
  SELECT $1, $2, $3, 1, f.token, n.t, n.t + $4::bigint * interval '1 microsecond', $6, $7
    FROM f, (SELECT clock_timestamp() AS t) n
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
SELECT token, holds, 0::bigint FROM ins WHERE granted
UNION ALL
SELECT 0, 0, GREATEST(0, floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000))::bigint FROM ins WHERE NOT granted
UNION ALL
SELECT 0, 0, GREATEST(0, floor(extract(epoch FROM (expires_at - clock_timestamp())) * 1000000))::bigint
  FROM sqllock_lease WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`

	// acquireMySQL is the second statement of an attempt, after fence.Next returned
	// token T. It inserts (or takes over an expired row, or re-enters) only if the
	// fencing counter is still T, read with a locking read (the latest committed value,
	// whatever the isolation level) that keeps the counter row locked until the
	// statement commits: an attempt that was overtaken by a later increment inserts
	// nothing and retries, so tokens cannot go backwards. In ON DUPLICATE KEY UPDATE
	// the assignments run left to right and see the new values of earlier columns, so
	// holds is computed first and expires_at, which the condition reads, last.
	// UTC_TIMESTAMP(6) is constant within a statement.
	//
	// The outcome is read from the insert id, never from the affected-rows count (which
	// depends on the client's clientFoundRows flag: with it, an ON DUPLICATE KEY UPDATE
	// that changes nothing reports 1 row, like an insert). The update branch always
	// evaluates LAST_INSERT_ID(2*token + granted), which the OK packet carries
	// (token is assigned that value DIV 2, its own value): odd means taken over or
	// re-entered, with the row's token; even means held by another owner. A plain
	// insert (the table has no AUTO_INCREMENT column) reports insert id 0 and one
	// row; an attempt overtaken by a later increment reports 0 and no row.
	//
	// A live row of the same owner is this acquisition's own: a reentrant acquisition
	// adds a hold, a retry after a lost reply adopts it.
	//
	// The update clause names the new values with parameters and the fence row's
	// column (f.token), not VALUES(col), which MySQL 8.0.20+ deprecates (1287) and
	// MariaDB's alias form would not parse.
	//
	// ? owner, TTL µs, host, pid, key, T, then in the update clause: reentrant, owner,
	// owner, host, pid, owner, owner, TTL µs.
	acquireMySQL = `INSERT INTO sqllock_lease (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
SELECT f.lock_key, f.name, ?, 1, f.token, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?
  FROM sqllock_fence f WHERE f.lock_key = ? AND f.token = ? FOR UPDATE
ON DUPLICATE KEY UPDATE
  sqllock_lease.holds       = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), 1, IF(? AND sqllock_lease.owner = ?, sqllock_lease.holds + 1, sqllock_lease.holds)),
  sqllock_lease.token       = LAST_INSERT_ID(2 * IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), f.token, sqllock_lease.token)
                                + IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6) OR sqllock_lease.owner = ?, 1, 0)) DIV 2,
  sqllock_lease.acquired_at = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), sqllock_lease.acquired_at),
  sqllock_lease.host        = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), ?, sqllock_lease.host),
  sqllock_lease.pid         = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), ?, sqllock_lease.pid),
  sqllock_lease.owner       = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6), ?, sqllock_lease.owner),
  sqllock_lease.expires_at  = IF(sqllock_lease.expires_at <= UTC_TIMESTAMP(6) OR sqllock_lease.owner = ?,
                   GREATEST(sqllock_lease.expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), sqllock_lease.expires_at)`

	// renew extends the lease if the row is still this lease's (key, owner, token)
	// and has not expired: expiry is final, an expired lease is never revived (it may
	// have been taken over and given back meanwhile, or be about to be).
	renewPostgres = `UPDATE sqllock_lease SET expires_at = GREATEST(expires_at, clock_timestamp() + $4::bigint * interval '1 microsecond')
WHERE lock_key = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp()`
	// GREATEST(expires_at + 1µs, ...) makes the row change, so that affected rows is 1
	// even within one microsecond (the MySQL driver reports changed rows).
	renewMySQL = `UPDATE sqllock_lease SET expires_at = GREATEST(expires_at + INTERVAL 1 MICROSECOND, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE lock_key = ? AND owner = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)`

	// release deletes the row of the last hold; on PostgreSQL it notifies waiters in
	// the same statement (delivered at commit), if an Acquire marked the row waited
	// for. One row per deleted row.
	releasePostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND holds <= 1
  AND ` + rowlease.AsyncRelease + ` RETURNING lock_key, waiters)
SELECT CASE WHEN waiters THEN pg_notify('` + channel + `', encode(lock_key, 'hex'))::text END FROM d`
	releaseMySQL = `DELETE FROM sqllock_lease WHERE lock_key = ? AND owner = ? AND token = ? AND holds <= 1`

	// forget deletes the row of an acquisition whose outcome the caller never learnt
	// and that it gave up (owners are unique per acquisition).
	forgetPostgres = `WITH d AS (DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND ` + rowlease.AsyncRelease + ` RETURNING lock_key)
SELECT count(*), string_agg(pg_notify('` + channel + `', encode(lock_key, 'hex'))::text, '') FROM d`
	forgetMySQL = `DELETE FROM sqllock_lease WHERE lock_key = ? AND owner = ?`
	// forgetProbeMySQL looks for that row without locking it (see Locker.forget).
	forgetProbeMySQL = `SELECT 1 FROM sqllock_lease WHERE lock_key = ? AND owner = ?`

	// unhold gives one hold of a reentrant lease back in one UPDATE, so that a
	// concurrent re-entry by the same owner is counted either before or after it,
	// never between two statements (an UPDATE that waits for a concurrent one re-reads
	// the row). The last hold (holds = 1; holds > 0 is a CHECK on PostgreSQL) is given
	// back by making the row expired: it is then free for the next acquirer, whose
	// takeover starts a new token, and unholdDone deletes it, best effort (the reaper
	// otherwise). PostgreSQL returns rows, rows freed, and notifies the waiters of a
	// freed row that was waited for; MySQL returns the hold count before the update as the insert id
	// (LAST_INSERT_ID(holds)), and its assignments run left to right, so expires_at
	// reads the count before holds is updated.
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
  holds = GREATEST(LAST_INSERT_ID(holds) - 1, 1)
WHERE lock_key = ? AND owner = ? AND token = ?`
	unholdDonePostgres = `DELETE FROM sqllock_lease WHERE lock_key = $1 AND owner = $2 AND token = $3 AND expires_at <= clock_timestamp()`
	unholdDoneMySQL    = `DELETE FROM sqllock_lease WHERE lock_key = ? AND owner = ? AND token = ? AND expires_at <= UTC_TIMESTAMP(6)`

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

	// MySQL sweeps in two statements, so that a batch locks only the rows it deletes,
	// by primary key. A locking range scan of the expires_at index (DELETE ... WHERE
	// expires_at < ? ORDER BY expires_at LIMIT n) takes next-key locks on the index
	// range and on the first entry past it, or, when the optimizer prefers a table
	// scan, locks every row it reads, live leases included; it then deadlocks with
	// Release, renewals and takeovers (error 1213, seen in CI).
	//
	// sweepSelectMySQL picks the candidates with a plain consistent read: no locks.
	// ? grace µs, limit.
	sweepSelectMySQL = `SELECT lock_key FROM sqllock_lease WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY expires_at LIMIT ?`
	// sweepDeleteMySQL (followed by the IN list of candidate keys, see
	// Sweeper.SweepBatch) deletes those candidates that are still expired when their
	// row lock is taken: a row taken over since the SELECT is kept. FORCE INDEX
	// (PRIMARY), in the multi-table form of DELETE that accepts it, makes the primary
	// key the only access path, whatever the statistics say (on a small table the
	// optimizer otherwise prefers a full scan, which at REPEATABLE READ locks every row
	// it reads, live ones included): rows are locked one by one in key order, so
	// concurrent reapers cannot deadlock with each other, and no index range of
	// expires_at is locked. ? grace µs, then the keys.
	sweepDeleteMySQL = `DELETE l FROM sqllock_lease l FORCE INDEX (PRIMARY)
WHERE l.expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND l.lock_key IN (`
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
