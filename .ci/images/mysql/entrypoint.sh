#!/bin/bash
# Entrypoint of sqllock-ci/mysql:9.7 (Debian sid's mysql-server: Oracle MySQL,
# not MariaDB), a stand-in for the official mysql image: same environment
# variables (MYSQL_ROOT_PASSWORD, MYSQL_ALLOW_EMPTY_PASSWORD,
# MYSQL_RANDOM_ROOT_PASSWORD, MYSQL_ROOT_HOST, MYSQL_DATABASE, MYSQL_USER,
# MYSQL_PASSWORD), same first-start sequence: `mysqld --initialize-insecure`,
# a temporary server on the Unix socket only that sets the root password and
# creates the database and user, /docker-entrypoint-initdb.d, stop; then the
# server on all interfaces with --skip-name-resolve. A data directory that is
# already initialised is used as it is (a restart takes about a second).
# Not supported: MYSQL_ONETIME_PASSWORD, time zone tables (MYSQL_INITDB_SKIP_TZINFO
# is implied). Arguments: `mysqld [options]` or `--option ...` go to the server;
# anything else is executed as is. The server logs to stderr. Debian's build
# prints "port: 3306  (Debian)" when ready, not the "MySQL Community Server"
# line the testcontainers mysql module waits for: wait on the port and a query.
set -Eeuo pipefail

DATADIR=/var/lib/mysql
SOCKET=/run/mysqld/mysqld.sock

log() { echo "entrypoint: $*" >&2; }

first=${1:-}
case $first in
mysqld) shift; set -- mysqld "$@" ;;
"" | -*) set -- mysqld "$@" ;;
*) exec "$@" ;;
esac

if [ "$(id -u)" = 0 ]; then
	mkdir -p "$DATADIR" /run/mysqld /var/lib/mysql-files
	chown mysql:mysql "$DATADIR" /run/mysqld /var/lib/mysql-files
	exec setpriv --reuid=mysql --regid=mysql --init-groups "$0" "$@"
fi

# From here on: the mysql user; "$@" is `mysqld [server options]`.
shift

sql_str() { # escape for a '...' SQL string literal
	local s=${1//\\/\\\\}
	printf '%s' "${s//\'/\\\'}"
}
sql_ident() { # escape for a `...` SQL identifier
	printf '%s' "${1//\`/\`\`}"
}

ROOT_PASSWORD=${MYSQL_ROOT_PASSWORD:-}
ALLOW_EMPTY=${MYSQL_ALLOW_EMPTY_PASSWORD:-}
RANDOM_ROOT=${MYSQL_RANDOM_ROOT_PASSWORD:-}
ROOT_HOST=${MYSQL_ROOT_HOST:-%}
DATABASE=${MYSQL_DATABASE:-}
USER_NAME=${MYSQL_USER:-}
USER_PASSWORD=${MYSQL_PASSWORD:-}

if [ ! -d "$DATADIR/mysql" ]; then
	if [ -z "$ROOT_PASSWORD" ] && [ -z "$ALLOW_EMPTY" ] && [ -z "$RANDOM_ROOT" ]; then
		log "error: database is uninitialized and password option is not specified"
		log "  You need to specify one of MYSQL_ROOT_PASSWORD, MYSQL_ALLOW_EMPTY_PASSWORD and MYSQL_RANDOM_ROOT_PASSWORD"
		exit 1
	fi
	if [ -n "$RANDOM_ROOT" ] && [ -z "$ROOT_PASSWORD" ]; then
		ROOT_PASSWORD=$(tr -dc 'A-Za-z0-9' </dev/urandom | head -c 32)
		echo "GENERATED ROOT PASSWORD: $ROOT_PASSWORD"
	fi

	log "initializing database files (mysqld --initialize-insecure)"
	# --initialize refuses a data directory with any file in it.
	find "$DATADIR" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
	mysqld "$@" --initialize-insecure --datadir="$DATADIR" --default-time-zone=SYSTEM

	log "starting temporary server (socket only)"
	mysqld "$@" --skip-networking --socket="$SOCKET" --default-time-zone=SYSTEM &
	tmp_pid=$!
	for i in $(seq 1 1200); do
		if mysqladmin --no-defaults --protocol=socket --socket="$SOCKET" -uroot \
			--connect-timeout=2 ping >/dev/null 2>&1; then
			break
		fi
		kill -0 "$tmp_pid" 2>/dev/null || { log "temporary server exited"; exit 1; }
		[ "$i" = 1200 ] && { log "temporary server did not start in 120 s"; exit 1; }
		sleep 0.1
	done

	pw=$(sql_str "$ROOT_PASSWORD")
	host=$(sql_str "$ROOT_HOST")
	{
		echo "SET @@SESSION.SQL_LOG_BIN=0;"
		echo "SET @@SESSION.SQL_MODE=REPLACE(@@SESSION.SQL_MODE, 'NO_BACKSLASH_ESCAPES', '');"
		echo "ALTER USER 'root'@'localhost' IDENTIFIED BY '$pw';"
		if [ "$ROOT_HOST" != localhost ]; then
			echo "CREATE USER IF NOT EXISTS 'root'@'$host' IDENTIFIED BY '$pw';"
			echo "GRANT ALL ON *.* TO 'root'@'$host' WITH GRANT OPTION;"
		fi
		if [ -n "$DATABASE" ]; then
			echo "CREATE DATABASE IF NOT EXISTS \`$(sql_ident "$DATABASE")\`;"
		fi
		if [ -n "$USER_NAME" ] && [ "$USER_NAME" != root ]; then
			echo "CREATE USER IF NOT EXISTS '$(sql_str "$USER_NAME")'@'%' IDENTIFIED BY '$(sql_str "$USER_PASSWORD")';"
			if [ -n "$DATABASE" ]; then
				echo "GRANT ALL ON \`$(sql_ident "$DATABASE")\`.* TO '$(sql_str "$USER_NAME")'@'%';"
			fi
		elif [ "$USER_NAME" = root ]; then
			log "MYSQL_USER=root is ignored: root is created from MYSQL_ROOT_PASSWORD"
		fi
		echo "FLUSH PRIVILEGES;"
	} | mysql --no-defaults --protocol=socket --socket="$SOCKET" -uroot

	cnf=$(mktemp /run/mysqld/client.XXXXXX.cnf)
	printf '[client]\nuser=root\npassword="%s"\nsocket=%s\nprotocol=socket\n' \
		"$(sql_str "$ROOT_PASSWORD")" "$SOCKET" >"$cnf"
	for f in /docker-entrypoint-initdb.d/*; do
		[ -e "$f" ] || continue
		db=()
		[ -n "$DATABASE" ] && db=(--database="$DATABASE")
		case $f in
		*.sh)
			# shellcheck disable=SC1090
			if [ -x "$f" ]; then log "running $f"; "$f"; else log "sourcing $f"; . "$f"; fi
			;;
		*.sql) log "running $f"; mysql --defaults-extra-file="$cnf" "${db[@]}" <"$f" ;;
		*.sql.gz) log "running $f"; gunzip -c "$f" | mysql --defaults-extra-file="$cnf" "${db[@]}" ;;
		*.sql.xz) log "running $f"; xzcat "$f" | mysql --defaults-extra-file="$cnf" "${db[@]}" ;;
		*) log "ignoring $f" ;;
		esac
	done
	rm -f "$cnf"

	log "stopping temporary server"
	kill -TERM "$tmp_pid"
	wait "$tmp_pid" || true
	log "MySQL init process done. Ready for start up."
else
	log "MySQL data directory appears to contain a database; skipping initialization"
fi

exec mysqld --skip-name-resolve --bind-address=0.0.0.0 "$@"
