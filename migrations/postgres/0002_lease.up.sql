-- sqllock_lease holds the leases of the uniqueindex strategy: one row per held lock.
-- lock_key is SHA-256(name), compared byte for byte. name keeps the original bytes
-- for display. owner is opaque. token comes from sqllock_fence. Times are the
-- database clock (clock_timestamp()) with microsecond precision.
CREATE TABLE IF NOT EXISTS sqllock_lease (
    lock_key    bytea PRIMARY KEY CHECK (length(lock_key) = 32),
    name        bytea NOT NULL,
    owner       bytea NOT NULL,
    holds       integer NOT NULL DEFAULT 1 CHECK (holds > 0),
    token       bigint NOT NULL CHECK (token > 0),
    acquired_at timestamptz(6) NOT NULL,
    expires_at  timestamptz(6) NOT NULL,
    host        text NOT NULL DEFAULT '',
    pid         bigint NOT NULL DEFAULT 0
);
-- The reaper scans expired rows in expiry order.
CREATE INDEX IF NOT EXISTS sqllock_lease_expires_at ON sqllock_lease (expires_at);
