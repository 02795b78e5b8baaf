DROP TABLE IF EXISTS sqllock_ticket;
DROP TABLE IF EXISTS sqllock_queue;
