ALTER TABLE sqllock_optimistic DROP COLUMN IF EXISTS waiters;
