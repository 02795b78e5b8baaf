DROP FUNCTION IF EXISTS sqllock_fairqueue_next(bytea, bigint, bigint);
DROP FUNCTION IF EXISTS sqllock_fairqueue_look(bytea, bigint, bigint);
