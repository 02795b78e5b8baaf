-- Scratch tables for the statement-shape comparison (see README.md), in a database
-- migrated by sqllock (migrations.Up): the epoch scripts use sqllock_epoch and
-- sqllock_token_seq. Re-runnable; drop the pgb_ tables afterwards.
DROP TABLE IF EXISTS pgb_raw, pgb_lease, pgb_fence, pgb_kept;
CREATE TABLE pgb_raw (name text PRIMARY KEY);
-- pgb_lease and pgb_kept have sqllock_lease's columns and its index on expires_at.
CREATE TABLE pgb_lease (LIKE sqllock_lease INCLUDING ALL);
CREATE TABLE pgb_kept (LIKE sqllock_lease INCLUDING ALL);
CREATE TABLE pgb_fence (LIKE sqllock_fence INCLUDING ALL);
-- A kept row is released in place: one free row per client (-c up to 64).
INSERT INTO pgb_kept (lock_key, name, owner, holds, token, acquired_at, expires_at)
SELECT sha256(('n' || g)::bytea), ('n' || g)::bytea, '', 1, 1, clock_timestamp(), clock_timestamp()
FROM generate_series(0, 63) g;
-- The server's run needs an epoch for the epoch-token scripts.
INSERT INTO sqllock_epoch (started, epoch)
SELECT pg_postmaster_start_time(), COALESCE(max(epoch), 0) + 1 FROM sqllock_epoch
ON CONFLICT (started) DO NOTHING;
