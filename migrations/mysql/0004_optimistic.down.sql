DROP TABLE IF EXISTS sqllock_optimistic;
