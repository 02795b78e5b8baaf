ALTER TABLE sqllock_rowlock DROP COLUMN epoch;
DROP TABLE IF EXISTS sqllock_run;
DROP TABLE IF EXISTS sqllock_epoch;
