#!/bin/sh
# Runs in the image's chroot after the packages are installed; VERSION is the
# MariaDB major.minor version (from the image's .conf).
set -eu
: "${VERSION:?}"
mariadbd --version | grep -qF " $VERSION."
# The package's postinst initialised a data directory: the entrypoint does
# that on first start, with the requested users and passwords.
rm -rf /var/lib/mysql
mkdir -p /var/lib/mysql /run/mysqld /docker-entrypoint-initdb.d
chown mysql:mysql /var/lib/mysql /run/mysqld
chmod 755 /run/mysqld
