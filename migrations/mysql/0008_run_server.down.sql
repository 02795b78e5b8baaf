ALTER TABLE sqllock_run DROP COLUMN server_id;
