DROP SEQUENCE IF EXISTS sqllock_token_seq;
DROP TABLE IF EXISTS sqllock_epoch;
