-- sqllock_queue holds the ticket dispenser of every name of the fairqueue strategy:
-- next_ticket is the next ticket to hand out. Rows are never deleted, so tickets
-- (which are the fencing tokens) keep increasing across restarts.
CREATE TABLE IF NOT EXISTS sqllock_queue (
    lock_key    bytea PRIMARY KEY CHECK (length(lock_key) = 32),
    name        bytea NOT NULL,
    next_ticket bigint NOT NULL CHECK (next_ticket > 0)
);
-- sqllock_ticket holds one row per waiter or holder: the lowest live tickets of a
-- name hold it. A ticket is live while expires_at (database clock) is in the
-- future; its owner renews it. Dead tickets are deleted by the next waiter or the
-- reaper.
CREATE TABLE IF NOT EXISTS sqllock_ticket (
    lock_key   bytea NOT NULL CHECK (length(lock_key) = 32),
    ticket     bigint NOT NULL,
    owner      bytea NOT NULL,
    created_at timestamptz(6) NOT NULL,
    expires_at timestamptz(6) NOT NULL,
    host       text NOT NULL DEFAULT '',
    pid        bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (lock_key, ticket)
);
CREATE INDEX IF NOT EXISTS sqllock_ticket_expires_at ON sqllock_ticket (expires_at);
