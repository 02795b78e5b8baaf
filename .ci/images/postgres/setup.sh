#!/bin/sh
# Runs in the image's chroot after the packages are installed; VERSION is the
# PostgreSQL major version (from the image's .conf).
set -eu
: "${VERSION:?}"
if [ -d "/etc/postgresql/$VERSION/main" ]; then
	pg_dropcluster "$VERSION" main
fi
test -x "/usr/lib/postgresql/$VERSION/bin/postgres"
"/usr/lib/postgresql/$VERSION/bin/postgres" --version | grep -q " $VERSION\."
# shared_preload_libraries = 'pg_stat_statements' needs the module.
test -f "/usr/lib/postgresql/$VERSION/lib/pg_stat_statements.so"
test -f "/usr/share/postgresql/$VERSION/extension/pg_stat_statements.control"
mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d
chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
chmod 700 /var/lib/postgresql/data
chmod 3777 /var/run/postgresql
