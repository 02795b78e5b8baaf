-- sqllock_fence keeps the fencing counter of every lock name. Rows are never deleted
-- by the library, so a name's token keeps increasing across releases, reaper sweeps
-- and restarts. lock_key is SHA-256(name); name keeps the original bytes for display.
CREATE TABLE IF NOT EXISTS sqllock_fence (
    lock_key bytea PRIMARY KEY CHECK (length(lock_key) = 32),
    name     bytea NOT NULL,
    token    bigint NOT NULL CHECK (token > 0)
);
