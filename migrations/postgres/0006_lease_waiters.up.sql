-- waiters is set by an Acquire that found the lease held and is about to wait for it
-- (its failed attempt, in the same statement), and cleared when an expired lease is
-- taken over. A release sends its NOTIFY only if it is set: NOTIFY serialises the
-- commits of the whole database (one lock at commit), so a lock nobody waits for
-- must not pay for it. A fast default: adding the column rewrites nothing.
ALTER TABLE sqllock_lease ADD COLUMN IF NOT EXISTS waiters boolean NOT NULL DEFAULT false;
