DROP TABLE IF EXISTS sqllock_runs;
