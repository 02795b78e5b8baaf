DROP TABLE IF EXISTS sqllock_lease;
