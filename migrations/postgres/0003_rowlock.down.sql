DROP TABLE IF EXISTS sqllock_rowlock;
DROP SEQUENCE IF EXISTS sqllock_rowlock_token_seq;
