-- sqllock_rowlock holds one row per lock name of the forupdate strategy. The lock is
-- the row lock of an open transaction: no column says who holds it. lock_key is
-- SHA-256(name); name keeps the original bytes for display. token is the fencing token
-- of the last committed acquisition and acquired_at its time. Rows are never deleted.
-- Tokens come from sqllock_rowlock_token_seq, drawn after the row lock is held: a
-- sequence is not rolled back, so a holder that rolled back or whose session died
-- never shares its token with the next holder.
CREATE SEQUENCE IF NOT EXISTS sqllock_rowlock_token_seq AS bigint;
CREATE TABLE IF NOT EXISTS sqllock_rowlock (
    lock_key    bytea PRIMARY KEY CHECK (length(lock_key) = 32),
    name        bytea NOT NULL,
    token       bigint NOT NULL DEFAULT 0 CHECK (token >= 0),
    acquired_at timestamptz
) WITH (fillfactor = 50);
