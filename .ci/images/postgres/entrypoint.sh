#!/bin/bash
# Entrypoint of the sqllock-ci/postgres:N images (Debian's postgresql-N; the
# image's PATH selects the version), a stand-in for the official postgres
# image: same environment variables (POSTGRES_USER, POSTGRES_PASSWORD,
# POSTGRES_DB, POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD), same
# first-start sequence (initdb, temporary socket-only server, create the
# database, /docker-entrypoint-initdb.d, stop), so the log shows "database
# system is ready to accept connections" twice on a first start and once on a
# restart of an initialised data directory. Arguments: `postgres -c k=v ...`
# or `-c k=v ...` go to the server; anything else is executed as is.
set -Eeuo pipefail

PGDATA=${PGDATA:-/var/lib/postgresql/data}
export PGDATA

log() { echo "entrypoint: $*" >&2; }

first=${1:-}
if [ "$first" = postgres ]; then
	shift
	set -- postgres "$@"
elif [ $# = 0 ] || [ "${first:0:1}" = - ]; then
	set -- postgres "$@"
else
	exec "$@"
fi

if [ "$(id -u)" = 0 ]; then
	mkdir -p "$PGDATA" /var/run/postgresql
	chown postgres:postgres "$PGDATA" /var/run/postgresql
	chmod 700 "$PGDATA"
	chmod 3777 /var/run/postgresql
	exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

# From here on: the postgres user; "$@" is `postgres [server options]`.
shift

POSTGRES_USER=${POSTGRES_USER:-postgres}
POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
POSTGRES_PASSWORD=${POSTGRES_PASSWORD:-}

run_initdb_d() {
	local f
	for f in /docker-entrypoint-initdb.d/*; do
		[ -e "$f" ] || continue
		case $f in
		*.sh)
			if [ -x "$f" ]; then
				log "running $f"
				"$f"
			else
				log "sourcing $f"
				# shellcheck disable=SC1090
				. "$f"
			fi
			;;
		*.sql) log "running $f"; psql_init -f "$f" ;;
		*.sql.gz) log "running $f"; gunzip -c "$f" | psql_init ;;
		*.sql.xz) log "running $f"; xzcat "$f" | psql_init ;;
		*) log "ignoring $f" ;;
		esac
	done
}

psql_init() {
	PGPASSWORD=$POSTGRES_PASSWORD psql -v ON_ERROR_STOP=1 --no-psqlrc --no-password \
		--username "$POSTGRES_USER" --dbname "$POSTGRES_DB" "$@"
}

if [ ! -s "$PGDATA/PG_VERSION" ]; then
	auth=${POSTGRES_HOST_AUTH_METHOD:-}
	if [ -z "$POSTGRES_PASSWORD" ] && [ "$auth" != trust ]; then
		log "Error: Database is uninitialized and superuser password is not specified."
		log "       Set POSTGRES_PASSWORD, or POSTGRES_HOST_AUTH_METHOD=trust."
		exit 1
	fi
	[ -n "$auth" ] || auth=scram-sha-256

	# shellcheck disable=SC2086
	initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") \
		--encoding=UTF8 ${POSTGRES_INITDB_ARGS:-}
	{
		echo
		echo "# sqllock-ci. fsync = off: test data need not survive a host crash"
		echo "# (the testcontainers postgres module also passes -c fsync=off)."
		echo "listen_addresses = '*'"
		echo "fsync = off"
		echo "max_connections = 500"
		echo "shared_preload_libraries = 'pg_stat_statements'"
	} >>"$PGDATA/postgresql.conf"
	printf '\nhost all all all %s\n' "$auth" >>"$PGDATA/pg_hba.conf"

	# Temporary server, Unix socket only.
	PGUSER=$POSTGRES_USER pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p 5432" -w start

	if [ "$POSTGRES_DB" != postgres ]; then
		exists=$(PGPASSWORD=$POSTGRES_PASSWORD psql -v ON_ERROR_STOP=1 --no-psqlrc --no-password -tA \
			--username "$POSTGRES_USER" --dbname postgres --set db="$POSTGRES_DB" \
			<<<"SELECT 1 FROM pg_database WHERE datname = :'db' ;")
		if [ -z "$exists" ]; then
			PGPASSWORD=$POSTGRES_PASSWORD psql -v ON_ERROR_STOP=1 --no-psqlrc --no-password -q \
				--username "$POSTGRES_USER" --dbname postgres --set db="$POSTGRES_DB" \
				<<<'CREATE DATABASE :"db" ;'
		fi
	fi
	run_initdb_d

	PGUSER=$POSTGRES_USER pg_ctl -D "$PGDATA" -m fast -w stop
	log "PostgreSQL init process complete; ready for start up."
else
	log "PostgreSQL Database directory appears to contain a database; Skipping initialization"
fi

exec postgres -D "$PGDATA" "$@"
