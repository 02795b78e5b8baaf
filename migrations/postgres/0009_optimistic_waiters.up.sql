-- waiters is set by an Acquire that found the optimistic lock held and waits for it
-- without the server-side line (reentrant acquisitions, a Locker whose line is full,
-- off or too small for its pool), and cleared by the release that frees the row. A
-- release sends its NOTIFY only if it is set or someone waits in the line: NOTIFY
-- serialises the commits of the whole database. A fast default: adding the column
-- rewrites nothing.
ALTER TABLE sqllock_optimistic ADD COLUMN IF NOT EXISTS waiters boolean NOT NULL DEFAULT false;
