-- The lease row kept after release (freed in place, as on MySQL) and taken over by an UPDATE
-- that draws an epoch token; the release is an UPDATE committed without waiting for its WAL flush.
UPDATE pgb_kept AS l SET token = n.ep * 17592186044416 + nextval('sqllock_token_seq'), owner = 'Lowner', holds = 1,
  acquired_at = n.t, expires_at = n.t + interval '30 s', host = 'host', pid = 1, waiters = false
FROM (SELECT clock_timestamp() AS t, (SELECT epoch FROM sqllock_epoch WHERE started = pg_postmaster_start_time()) AS ep) n
WHERE l.lock_key = sha256(('n' || :client_id)::bytea) AND (l.owner = '' OR l.expires_at <= n.t) AND n.ep IS NOT NULL
RETURNING l.token;
UPDATE pgb_kept SET owner = '', expires_at = LEAST(expires_at, clock_timestamp())
WHERE lock_key = sha256(('n' || :client_id)::bytea) AND owner = 'Lowner' AND set_config('synchronous_commit', 'off', true) IS NOT NULL;
