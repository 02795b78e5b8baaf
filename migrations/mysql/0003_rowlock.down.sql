DROP TABLE IF EXISTS sqllock_rowlock;
