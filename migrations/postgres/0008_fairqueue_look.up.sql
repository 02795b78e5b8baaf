-- sqllock_fairqueue_look is a fairqueue waiter's look at the tickets below its own, t,
-- of key k: the nearest live ones, at most n (the permits), with their remaining
-- lease in µs, then a row (0, -1) if a ticket below t is dead (expired). A waiter
-- holds the lock when fewer than n rows of live tickets come back (once it dropped
-- the dead ones).
--
-- It is a function, VOLATILE, for its snapshot: a volatile function takes a fresh
-- snapshot for its query. Called in the statement that draws t, after the draw, it
-- sees every lower ticket: those drawn by the enqueues this draw waited for on the
-- name's dispenser committed before the draw went on, after the statement's own
-- snapshot was taken. The live tickets it returns are locked FOR KEY SHARE, which
-- waits for a delete of one of them under way and then skips it, and makes the
-- release that deletes one wait for the commit of the look (see the fairqueue
-- package's release statement). KEY SHARE conflicts with nothing else: not with a
-- renewal, nor with a Check.
CREATE OR REPLACE FUNCTION sqllock_fairqueue_look(k bytea, t bigint, n bigint)
RETURNS TABLE (pred bigint, rem bigint) LANGUAGE sql VOLATILE AS $$
SELECT live.ticket, floor(extract(epoch FROM (live.expires_at - clock_timestamp())) * 1000000)::bigint FROM (
  SELECT s.ticket, s.expires_at FROM sqllock_ticket s
  WHERE s.lock_key = k AND s.ticket < t AND s.expires_at > clock_timestamp()
  ORDER BY s.ticket DESC LIMIT n FOR KEY SHARE
) live
UNION ALL
SELECT 0, -1 WHERE EXISTS (
  SELECT 1 FROM sqllock_ticket s WHERE s.lock_key = k AND s.ticket < t AND s.expires_at <= clock_timestamp()
)
$$;
-- sqllock_fairqueue_next tells the release of ticket t of key k, called after its
-- delete in the same statement, whom that release concerns: grantee, the n-th lowest
-- ticket left (n the permits) when the n lowest are all live, which holds from the
-- release's commit on (no lower ticket can appear any more, none below it is dead),
-- or NULL; and waited, whether someone may wait for t: a ticket above t is left, and
-- at least n tickets are (a waiter that saw t among the n live tickets nearest below
-- it is one of n or more; fewer are all holders).
-- VOLATILE, for its fresh snapshot: a waiter that watches t locked it in its look
-- (sqllock_fairqueue_look), so the delete of t waited for the commit of that look,
-- after the statement's own snapshot was taken; this snapshot, taken after the
-- delete, sees that waiter's ticket. A look that comes after the delete waits for the
-- release's commit and finds t deleted.
CREATE OR REPLACE FUNCTION sqllock_fairqueue_next(k bytea, t bigint, n bigint)
RETURNS TABLE (grantee bigint, waited boolean) LANGUAGE sql VOLATILE AS $$
SELECT CASE WHEN count(*) = n AND bool_and(r.live) THEN max(r.ticket) END,
  count(*) = n AND EXISTS (SELECT 1 FROM sqllock_ticket s WHERE s.lock_key = k AND s.ticket > t)
FROM (
  SELECT s.ticket, s.expires_at > clock_timestamp() AS live FROM sqllock_ticket s
  WHERE s.lock_key = k AND s.ticket <> t ORDER BY s.ticket LIMIT n
) r
$$;
