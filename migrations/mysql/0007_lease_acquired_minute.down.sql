ALTER TABLE sqllock_lease
    ADD KEY sqllock_lease_expires_at (expires_at),
    DROP KEY sqllock_lease_acquired_min,
    DROP COLUMN acquired_min;
