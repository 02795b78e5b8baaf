-- sqllock_rowlock holds one row per lock name of the forupdate strategy. The lock is
-- the row lock of an open transaction: no column says who holds it. lock_key is
-- SHA-256(name); name keeps the original bytes for display. token is the fencing token
-- of the last committed acquisition and acquired_at (UTC) its time. Rows are never
-- deleted. A holder, once it holds the row lock, REPLACEs its row: the new row draws
-- a new AUTO_INCREMENT token, and AUTO_INCREMENT values are not reused after a
-- rollback, so a holder whose session died never shares its token with the next one.
CREATE TABLE IF NOT EXISTS sqllock_rowlock (
    lock_key    BINARY(32) NOT NULL PRIMARY KEY,
    name        VARBINARY(4096) NOT NULL,
    token       BIGINT NOT NULL AUTO_INCREMENT,
    acquired_at DATETIME(6) NULL,
    UNIQUE KEY sqllock_rowlock_token (token)
) ENGINE=InnoDB;
