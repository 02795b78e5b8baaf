#!/bin/sh
# Runs in the image's chroot after the packages are installed: the data
# templates (Galera n1's data directory, PostgreSQL's initdb with database
# locktest), so that the container starts faster. No server is started.
set -eu
rm -rf /var/lib/mysql
test -x /usr/lib/postgresql/15/bin/postgres
test -f /usr/lib/galera/libgalera_smm.so
ha-lab prepare
