-- Fencing tokens that cost no commit of their own (advisory on PostgreSQL): a token is
-- epoch * 2^44 + nextval('sqllock_token_seq'), read in the locking statement itself.
-- The sequence never goes back while the server runs, but values handed out just
-- before a crash may be handed out again after it (sequence increments are logged 32
-- at a time and not flushed per call). So each run of the server (identified by
-- pg_postmaster_start_time()) gets an epoch of its own, inserted with a synchronous
-- commit before its first token: every token of a run is larger than every token of
-- the runs before it. Tokens are strictly increasing per name (and across names).
CREATE TABLE IF NOT EXISTS sqllock_epoch (
    started timestamptz(6) PRIMARY KEY,
    epoch   bigint NOT NULL UNIQUE CHECK (epoch > 0 AND epoch < 524288)
);
CREATE SEQUENCE IF NOT EXISTS sqllock_token_seq MAXVALUE 17592186044415;
