DROP TABLE IF EXISTS sqllock_run;
DROP TABLE IF EXISTS sqllock_epoch;
