-- sqllock_queue holds the ticket dispenser of every name of the fairqueue strategy:
-- next_ticket is the next ticket to hand out. Rows are never deleted, so tickets
-- (which are the fencing tokens) keep increasing across restarts.
CREATE TABLE IF NOT EXISTS sqllock_queue (
    lock_key    BINARY(32) NOT NULL PRIMARY KEY,
    name        VARBINARY(4096) NOT NULL,
    next_ticket BIGINT NOT NULL
) ENGINE=InnoDB;
-- sqllock_ticket holds one row per waiter or holder: the lowest live tickets of a
-- name hold it. A ticket is live while expires_at (UTC, database clock) is in the
-- future; its owner renews it. Dead tickets are deleted by the next waiter or the
-- reaper.
CREATE TABLE IF NOT EXISTS sqllock_ticket (
    lock_key   BINARY(32) NOT NULL,
    ticket     BIGINT NOT NULL,
    owner      VARBINARY(64) NOT NULL,
    created_at DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    host       VARCHAR(255) NOT NULL DEFAULT '',
    pid        BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (lock_key, ticket),
    KEY sqllock_ticket_expires_at (expires_at)
) ENGINE=InnoDB;
