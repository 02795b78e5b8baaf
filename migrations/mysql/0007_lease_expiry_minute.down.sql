ALTER TABLE sqllock_lease
    ADD KEY sqllock_lease_expires_at (expires_at),
    DROP KEY sqllock_lease_expires_min,
    DROP COLUMN expires_min;
