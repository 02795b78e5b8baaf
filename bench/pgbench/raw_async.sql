-- raw.sql with the DELETE committed without waiting for its WAL flush (as sqllock's release).
INSERT INTO pgb_raw (name) VALUES ('n' || :client_id) ON CONFLICT DO NOTHING;
DELETE FROM pgb_raw WHERE name = 'n' || :client_id AND set_config('synchronous_commit', 'off', true) IS NOT NULL;
