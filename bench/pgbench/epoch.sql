-- The lease row inserted with an epoch token (as advisory draws them: no counter row of the
-- name is written), deleted at release as today.
WITH n AS (SELECT clock_timestamp() AS t, (SELECT epoch FROM sqllock_epoch WHERE started = pg_postmaster_start_time()) AS ep)
INSERT INTO pgb_lease AS l (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid)
SELECT sha256(('n' || :client_id)::bytea), ('n' || :client_id)::bytea, 'Lowner', 1, n.ep * 17592186044416 + nextval('sqllock_token_seq'), n.t, n.t + interval '30 s', 'host', 1
FROM n WHERE n.ep IS NOT NULL
ON CONFLICT (lock_key) DO UPDATE SET holds = 1 WHERE l.expires_at <= excluded.acquired_at RETURNING l.token;
DELETE FROM pgb_lease WHERE lock_key = sha256(('n' || :client_id)::bytea) AND owner = 'Lowner' AND set_config('synchronous_commit', 'off', true) IS NOT NULL;
