-- sqllock_optimistic holds one row per lock name of the optimistic strategy, kept
-- while the name is in use. version is the fencing token: each acquisition is a
-- compare-and-swap that increments it. A row is held while expires_at (UTC, database
-- clock) is in the future; a free row's expires_at is when it became free. The
-- reaper deletes rows free for longer than a grace period, after recording their
-- version in sqllock_fence, from which a re-created row's next version continues.
CREATE TABLE IF NOT EXISTS sqllock_optimistic (
    lock_key    BINARY(32) NOT NULL PRIMARY KEY,
    name        VARBINARY(4096) NOT NULL,
    version     BIGINT NOT NULL DEFAULT 0,
    owner       VARBINARY(64) NOT NULL DEFAULT '',
    holds       INT NOT NULL DEFAULT 0,
    acquired_at DATETIME(6) NULL,
    expires_at  DATETIME(6) NOT NULL,
    host        VARCHAR(255) NOT NULL DEFAULT '',
    pid         BIGINT NOT NULL DEFAULT 0,
    KEY sqllock_optimistic_expires_at (expires_at)
) ENGINE=InnoDB;
