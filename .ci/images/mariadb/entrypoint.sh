#!/bin/bash
# Entrypoint of the sqllock-ci/mariadb:N images (Debian's mariadb-server of the
# image's suite: 10.11 bookworm, 11.8 trixie), a stand-in for the official
# mysql/mariadb images: same environment variables (MYSQL_ROOT_PASSWORD,
# MYSQL_ALLOW_EMPTY_PASSWORD, MYSQL_RANDOM_ROOT_PASSWORD, MYSQL_ROOT_HOST,
# MYSQL_DATABASE, MYSQL_USER, MYSQL_PASSWORD, and their MARIADB_* twins, which
# win), same first-start sequence (mariadb-install-db, temporary
# server on the Unix socket only, users and database, /docker-entrypoint-initdb.d,
# stop). A data directory that is already initialised is used as it is.
# Arguments: `mariadbd|mysqld [options]` or `--option ...` go to the server;
# anything else is executed as is.
set -Eeuo pipefail

DATADIR=/var/lib/mysql
SOCKET=/run/mysqld/mysqld.sock

log() { echo "entrypoint: $*" >&2; }

first=${1:-}
case $first in
mariadbd | mysqld) shift; set -- mariadbd "$@" ;;
"" | -*) set -- mariadbd "$@" ;;
*) exec "$@" ;;
esac

if [ "$(id -u)" = 0 ]; then
	mkdir -p "$DATADIR" /run/mysqld
	chown mysql:mysql "$DATADIR" /run/mysqld
	exec setpriv --reuid=mysql --regid=mysql --init-groups "$0" "$@"
fi

# From here on: the mysql user; "$@" is `mariadbd [server options]`.
shift

env_var() { # NAME: $MARIADB_NAME, else $MYSQL_NAME, else empty
	local m=MARIADB_$1 y=MYSQL_$1
	printf '%s' "${!m:-${!y:-}}"
}
sql_str() { # escape for a '...' SQL string literal
	local s=${1//\\/\\\\}
	printf '%s' "${s//\'/\\\'}"
}
sql_ident() { # escape for a `...` SQL identifier
	printf '%s' "${1//\`/\`\`}"
}

ROOT_PASSWORD=$(env_var ROOT_PASSWORD)
ALLOW_EMPTY=$(env_var ALLOW_EMPTY_PASSWORD)
ALLOW_EMPTY=${ALLOW_EMPTY:-$(env_var ALLOW_EMPTY_ROOT_PASSWORD)}
RANDOM_ROOT=$(env_var RANDOM_ROOT_PASSWORD)
ROOT_HOST=$(env_var ROOT_HOST)
ROOT_HOST=${ROOT_HOST:-%}
DATABASE=$(env_var DATABASE)
USER_NAME=$(env_var USER)
USER_PASSWORD=$(env_var PASSWORD)

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

	log "initializing database files"
	mariadb-install-db --datadir="$DATADIR" --rpm --auth-root-authentication-method=normal \
		--skip-test-db --skip-name-resolve \
		--default-time-zone=SYSTEM --skip-log-bin --expire-logs-days=0 >/dev/null

	log "starting temporary server (socket only)"
	mariadbd --skip-networking --skip-name-resolve --socket="$SOCKET" --skip-log-bin \
		--loose-innodb_buffer_pool_load_at_startup=0 "$@" &
	tmp_pid=$!
	for i in $(seq 1 600); do
		if mariadb-admin --no-defaults --protocol=socket --socket="$SOCKET" -uroot ping >/dev/null 2>&1; then
			break
		fi
		kill -0 "$tmp_pid" 2>/dev/null || { log "temporary server exited"; exit 1; }
		[ "$i" = 600 ] && { log "temporary server did not start in 60 s"; exit 1; }
		sleep 0.1
	done

	pw=$(sql_str "$ROOT_PASSWORD")
	host=$(sql_str "$ROOT_HOST")
	{
		# One statement per line.
		echo "SET @@SESSION.SQL_LOG_BIN=0;"
		echo "SET @@SESSION.SQL_MODE=REPLACE(@@SESSION.SQL_MODE, 'NO_BACKSLASH_ESCAPES', '');"
		echo "DROP USER IF EXISTS root@'127.0.0.1', root@'::1';"
		# shellcheck disable=SC2028 # the backslashes are for SQL
		echo "EXECUTE IMMEDIATE CONCAT('DROP USER IF EXISTS root@\\'', @@hostname, '\\'');"
		echo "SET PASSWORD FOR 'root'@'localhost' = PASSWORD('$pw');"
		if [ "$ROOT_HOST" != localhost ]; then
			echo "CREATE USER IF NOT EXISTS 'root'@'$host' IDENTIFIED BY '$pw';"
			echo "GRANT ALL ON *.* TO 'root'@'$host' WITH GRANT OPTION;"
			echo "GRANT PROXY ON ''@'%' TO 'root'@'$host' WITH GRANT OPTION;"
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
	} | mariadb --no-defaults --protocol=socket --socket="$SOCKET" -uroot

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
		*.sql) log "running $f"; mariadb --defaults-extra-file="$cnf" "${db[@]}" <"$f" ;;
		*.sql.gz) log "running $f"; gunzip -c "$f" | mariadb --defaults-extra-file="$cnf" "${db[@]}" ;;
		*.sql.xz) log "running $f"; xzcat "$f" | mariadb --defaults-extra-file="$cnf" "${db[@]}" ;;
		*) log "ignoring $f" ;;
		esac
	done
	rm -f "$cnf"

	log "stopping temporary server"
	kill -TERM "$tmp_pid"
	wait "$tmp_pid" || true
	log "MariaDB init process done. Ready for start up."
else
	log "MariaDB data directory appears to contain a database; skipping initialization"
fi

exec mariadbd --skip-name-resolve --bind-address=0.0.0.0 "$@"
