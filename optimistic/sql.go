package optimistic

import "github.com/sqllock/sqllock/internal/rowlease"

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
	// Its version starts at 0; the first acquisition continues from sqllock_fence.
	createPostgres = `INSERT INTO sqllock_optimistic (lock_key, name, expires_at) VALUES ($1, $2, clock_timestamp())
ON CONFLICT (lock_key) DO NOTHING`
	createMySQL = `INSERT INTO sqllock_optimistic (lock_key, name, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE lock_key = lock_key`

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
  owner = $3, holds = 1, acquired_at = n.t, expires_at = n.t + $4::bigint * interval '1 microsecond', host = $5, pid = $6
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
	// expires_at = now, the time it became free), and on PostgreSQL notifies the
	// waiters in the same statement. On PostgreSQL it returns no row if the lease was
	// not found, one if holds are left and two if the row was freed (the caller reads
	// the row count of an Exec); on MySQL the insert id reports the holds left.
	releasePostgres = `WITH u AS (
  UPDATE sqllock_optimistic SET holds = GREATEST(holds - 1, 0),
    owner = CASE WHEN holds <= 1 THEN ''::bytea ELSE owner END,
    expires_at = CASE WHEN holds <= 1 THEN clock_timestamp() ELSE expires_at END
  WHERE lock_key = $1 AND version = $2 AND owner = $3 AND ` + rowlease.AsyncRelease + `
  RETURNING lock_key, holds
)
SELECT CASE WHEN u.holds = 0 AND g = 1 THEN pg_notify('` + channel + `', encode(u.lock_key, 'hex')) END
FROM u CROSS JOIN generate_series(1, CASE WHEN u.holds = 0 THEN 2 ELSE 1 END) g`
	// MySQL runs the assignments left to right: owner and expires_at read the holds
	// before the update, which comes last.
	releaseMySQL = `UPDATE sqllock_optimistic SET
  owner = IF(holds <= 1, '', owner),
  expires_at = IF(holds <= 1, UTC_TIMESTAMP(6), expires_at),
  holds = LAST_INSERT_ID(GREATEST(holds - 1, 0))
WHERE lock_key = ? AND version = ? AND owner = ?`

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

	// MySQL sweeps a batch in a transaction: the candidates are read without locks,
	// their fence counters raised under the rows' locks (a locking read of the
	// candidates, by primary key, still free), then they are deleted. ? grace µs,
	// limit.
	sweepSelectMySQL = `SELECT lock_key FROM sqllock_optimistic WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY expires_at LIMIT ?`
	// Followed by the IN list of keys and ")". ? grace µs.
	sweepFenceMySQL = `INSERT INTO sqllock_fence (lock_key, name, token)
SELECT o.lock_key, o.name, o.version FROM sqllock_optimistic o FORCE INDEX (PRIMARY)
WHERE o.version > 0 AND o.expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND o.lock_key IN (`
	sweepFenceTailMySQL = `) FOR UPDATE
ON DUPLICATE KEY UPDATE token = GREATEST(sqllock_fence.token, o.version)` // not VALUES(token): deprecated on MySQL (1287)
	sweepDeleteMySQL = `DELETE o FROM sqllock_optimistic o FORCE INDEX (PRIMARY)
WHERE o.expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND o.lock_key IN (`
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
