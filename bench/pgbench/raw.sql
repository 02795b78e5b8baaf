-- bench/'s raw uniqueindex cell: INSERT and DELETE of a one-column row, both committed synchronously.
INSERT INTO pgb_raw (name) VALUES ('n' || :client_id) ON CONFLICT DO NOTHING;
DELETE FROM pgb_raw WHERE name = 'n' || :client_id;
