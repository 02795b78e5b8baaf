-- sqllock_optimistic holds one row per lock name of the optimistic strategy, kept
-- while the name is in use. version is the fencing token: each acquisition is a
-- compare-and-swap that increments it. A row is held while expires_at (database
-- clock) is in the future; a free row's expires_at is when it became free. The
-- reaper deletes rows free for longer than a grace period, after recording their
-- version in sqllock_fence, from which a re-created row's next version continues.
CREATE TABLE IF NOT EXISTS sqllock_optimistic (
    lock_key    bytea PRIMARY KEY CHECK (length(lock_key) = 32),
    name        bytea NOT NULL,
    version     bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    owner       bytea NOT NULL DEFAULT '',
    holds       integer NOT NULL DEFAULT 0 CHECK (holds >= 0),
    acquired_at timestamptz(6),
    expires_at  timestamptz(6) NOT NULL,
    host        text NOT NULL DEFAULT '',
    pid         bigint NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sqllock_optimistic_expires_at ON sqllock_optimistic (expires_at);
