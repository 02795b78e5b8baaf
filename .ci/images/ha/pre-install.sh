#!/bin/sh
# Runs in the image's chroot before the packages are installed.
set -eu
# No default PostgreSQL cluster: ha-lab makes its own.
mkdir -p /etc/postgresql-common/createcluster.d
echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/sqllock-ci.conf
