-- sqllock_fence keeps the fencing counter of every lock name. Rows are never deleted
-- by the library, so a name's token keeps increasing across releases, reaper sweeps
-- and restarts. lock_key is SHA-256(name); name keeps the original bytes for display.
CREATE TABLE IF NOT EXISTS sqllock_fence (
    lock_key BINARY(32) NOT NULL PRIMARY KEY,
    name     VARBINARY(4096) NOT NULL,
    token    BIGINT NOT NULL
) ENGINE=InnoDB;
