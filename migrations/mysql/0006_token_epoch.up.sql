-- Fencing tokens that cost no commit of their own (advisory on MySQL, like PostgreSQL's
-- 0007): a token is epoch * 2^44 + a counter, drawn by one autocommit UPDATE of the
-- MEMORY table sqllock_run, which holds the last token of the server's current run.
-- A MEMORY table is emptied whenever the server starts, so a crash can never make the
-- counter hand out a value twice: the first draw of a run finds no row and records a
-- new epoch in sqllock_epoch (InnoDB, committed), one above the largest, before it
-- seeds the counter with it. Rows of sqllock_epoch must never be deleted.
CREATE TABLE IF NOT EXISTS sqllock_epoch (
    epoch      BIGINT NOT NULL PRIMARY KEY,
    created_at DATETIME(6) NOT NULL,
    CONSTRAINT sqllock_epoch_range CHECK (epoch > 0 AND epoch < 524288)
) ENGINE=InnoDB;
CREATE TABLE IF NOT EXISTS sqllock_run (
    id TINYINT NOT NULL PRIMARY KEY,
    v  BIGINT NOT NULL
) ENGINE=MEMORY;
