#!/bin/sh
# Runs in the image's chroot after the packages are installed.
set -eu
mariadbd --version | grep -q ' 10\.11\.'
# The package's postinst initialised a data directory: the entrypoint does
# that on first start, with the requested users and passwords.
rm -rf /var/lib/mysql
mkdir -p /var/lib/mysql /run/mysqld /docker-entrypoint-initdb.d
chown mysql:mysql /var/lib/mysql /run/mysqld
chmod 755 /run/mysqld
