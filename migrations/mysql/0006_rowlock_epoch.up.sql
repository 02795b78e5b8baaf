-- Fencing tokens of forupdate that grow across server crashes (the MySQL form of
-- PostgreSQL's 0007). An AUTO_INCREMENT value drawn by a lock transaction that never
-- committed is not durable: after a crash InnoDB may hand it out again, though the
-- dead holder may have shown it to a resource. So a token is
-- epoch * 2^40 + AUTO_INCREMENT value, where the epoch grows with every server run:
-- sqllock_epoch records one epoch per run, durably (one committed row), and
-- sqllock_run, a MEMORY table, which the server empties whenever it starts, holds
-- the epoch of the current run. sqllock_rowlock.epoch is the epoch of its token.
CREATE TABLE IF NOT EXISTS sqllock_epoch (
    epoch      BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    created_at DATETIME(6) NOT NULL
) ENGINE=InnoDB;
CREATE TABLE IF NOT EXISTS sqllock_run (
    id    TINYINT NOT NULL PRIMARY KEY,
    epoch BIGINT NOT NULL
) ENGINE=MEMORY;
ALTER TABLE sqllock_rowlock ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;
