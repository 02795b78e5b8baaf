#!/bin/sh
# Runs in the image's chroot after the packages are installed.
set -eu
if [ -d /etc/postgresql/15/main ]; then
	pg_dropcluster 15 main
fi
test -x /usr/lib/postgresql/15/bin/postgres
# shared_preload_libraries = 'pg_stat_statements' needs the module.
test -f /usr/lib/postgresql/15/lib/pg_stat_statements.so
test -f /usr/share/postgresql/15/extension/pg_stat_statements.control
mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d
chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
chmod 700 /var/lib/postgresql/data
chmod 3777 /var/run/postgresql
