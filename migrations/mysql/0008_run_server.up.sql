-- The server a run of sqllock_run's counter belongs to (fence.MySQLRun): the
-- @@server_id of the server that recorded the run's epoch. Replication copies
-- sqllock_run's row to replicas, so a promoted replica used to go on in its former
-- source's run, and forupdate's tokens drawn in transactions that never committed
-- (the leases held at the failover) could be handed out again. Draws now require the
-- row to be the server's own, and a server that finds its former source's row
-- records a run of its own: a new epoch, above every epoch it has. Rows written
-- before this migration have server_id 0 and take a new epoch once.
ALTER TABLE sqllock_run ADD COLUMN server_id BIGINT UNSIGNED NOT NULL DEFAULT 0;
