DROP TABLE IF EXISTS sqllock_fence;
