-- uniqueindex today (the shape of acquirePostgres, without its waiters mark and hint): the
-- name's sqllock_fence counter incremented in the statement that inserts the lease row;
-- the release deletes it, committed without waiting for its WAL flush.
WITH f AS (
  INSERT INTO pgb_fence AS f (lock_key, name, token) VALUES (sha256(('n' || :client_id)::bytea), ('n' || :client_id)::bytea, 1)
  ON CONFLICT (lock_key) DO UPDATE SET token = f.token + 1 RETURNING token)
INSERT INTO pgb_lease AS l (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
SELECT sha256(('n' || :client_id)::bytea), ('n' || :client_id)::bytea, 'Lowner', 1, f.token, clock_timestamp(), clock_timestamp() + interval '30 s', 'host', 1 FROM f
ON CONFLICT (lock_key) DO UPDATE SET holds = 1 WHERE l.expires_at <= excluded.acquired_at RETURNING l.token;
DELETE FROM pgb_lease WHERE lock_key = sha256(('n' || :client_id)::bytea) AND owner = 'Lowner' AND set_config('synchronous_commit', 'off', true) IS NOT NULL;
