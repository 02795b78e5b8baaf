-- The runs of the server for fencing tokens that cost no commit and write nothing
-- (advisory's and forupdate's on MySQL; internal/fence MySQLRun): a token is
-- epoch * 2^44 plus the server's UUID_SHORT() values since its run began. One row
-- per run: its epoch (recorded in sqllock_epoch, committed, before the row), base
-- (UUID_SHORT() when the run began) and the @@server_id of the server whose run it
-- is. A MEMORY table is emptied whenever the server starts, so every run records a
-- new epoch. Rows are only ever inserted: replication carries them to replicas as
-- inserts of new keys, which a replica that restarted (and lost its MEMORY tables)
-- applies all the same, and a promoted replica, whose newest row is its former
-- source's, records a run of its own. It replaces 0006's sqllock_run, whose counter
-- was updated by every draw (a row change that stopped a restarted replica with
-- error 1032) and which a promoted replica went on from; sqllock_run stays for
-- processes of an earlier version until they are stopped.
CREATE TABLE IF NOT EXISTS sqllock_runs (
    epoch     BIGINT NOT NULL,
    base      BIGINT UNSIGNED NOT NULL,
    server_id BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY USING BTREE (epoch)
) ENGINE=MEMORY;
