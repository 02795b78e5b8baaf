ALTER TABLE sqllock_lease DROP COLUMN IF EXISTS waiters;
