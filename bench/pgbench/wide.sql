-- fence.sql's lease row without the counter: a constant token, no CTE (what the counter's
-- upsert costs), deleted as today.
INSERT INTO pgb_lease (lock_key, name, owner, holds, token, acquired_at, expires_at, host, pid) VALUES (sha256(('n' || :client_id)::bytea), ('n' || :client_id)::bytea, 'Lowner', 1, 1, clock_timestamp(), clock_timestamp() + interval '30 s', 'host', 1) ON CONFLICT DO NOTHING;
DELETE FROM pgb_lease WHERE lock_key = sha256(('n' || :client_id)::bytea) AND owner = 'Lowner' AND set_config('synchronous_commit', 'off', true) IS NOT NULL;
