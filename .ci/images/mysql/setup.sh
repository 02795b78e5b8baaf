#!/bin/sh
# Runs in the image's chroot after the packages are installed; VERSION is the
# MySQL major.minor version (from the image's .conf).
set -eu
: "${VERSION:?}"
mysqld --version | grep -qF " $VERSION."
if mysqld --version | grep -qi mariadb; then
	echo "setup.sh: mysqld is MariaDB, not Oracle MySQL" >&2
	exit 1
fi
# Debian's mysqld.cnf logs to /var/log/mysql/error.log and binds 127.0.0.1 (and
# mysqlx to 127.0.0.1): a container logs to stderr, binds all interfaces.
cnf=/etc/mysql/mysql.conf.d/mysqld.cnf
sed -i -E 's/^[[:space:]]*(log[-_]error|bind[-_]address|mysqlx[-_]bind[-_]address)[[:space:]]*=/# sqllock-ci: &/' "$cnf"
if grep -Eq '^[[:space:]]*(log[-_]error|bind[-_]address)[[:space:]]*=' /etc/mysql/my.cnf /etc/mysql/conf.d/* /etc/mysql/mysql.conf.d/* 2>/dev/null; then
	echo "setup.sh: a log-error or bind-address setting is left in /etc/mysql" >&2
	exit 1
fi
# The package's postinst initialised a data directory (the entrypoint does that
# on first start, with the requested users and passwords). It ran in a network
# namespace of its own (build.sh), so it found 3306 free; the port backoff files
# it writes when it does not are removed all the same.
rm -f /etc/mysql/mysql.conf.d/99-port-backoff.cnf /etc/mysql/conf.d/99-port-backoff.cnf
rm -rf /var/lib/mysql /var/log/mysql/*
mkdir -p /var/lib/mysql /var/lib/mysql-files /run/mysqld /docker-entrypoint-initdb.d
chown mysql:mysql /var/lib/mysql /var/lib/mysql-files /run/mysqld
chmod 750 /var/lib/mysql
chmod 700 /var/lib/mysql-files
chmod 755 /run/mysqld
