-- sqllock_lease holds the leases of the uniqueindex strategy: one row per held lock.
-- lock_key is SHA-256(name), compared byte for byte. name keeps the original bytes
-- for display. owner is opaque. token comes from sqllock_fence. Times are UTC on the
-- database clock (UTC_TIMESTAMP(6)) with microsecond precision.
CREATE TABLE IF NOT EXISTS sqllock_lease (
    lock_key    BINARY(32) NOT NULL PRIMARY KEY,
    name        VARBINARY(4096) NOT NULL,
    owner       VARBINARY(4097) NOT NULL,
    holds       INT NOT NULL DEFAULT 1,
    token       BIGINT NOT NULL,
    acquired_at DATETIME(6) NOT NULL,
    expires_at  DATETIME(6) NOT NULL,
    host        VARCHAR(255) NOT NULL DEFAULT '',
    pid         BIGINT NOT NULL DEFAULT 0,
    KEY sqllock_lease_expires_at (expires_at)
) ENGINE=InnoDB;
