#!/bin/bash
# Entrypoint of sqllock-ci/ha:bookworm: the HA lab (ha-lab run: Galera, the
# PostgreSQL pair in sync mode, pgbouncer; "ha-lab: ready" when all serve SQL,
# then waits; SIGTERM stops the servers). Other commands are executed as is.
set -euo pipefail
[ $# -gt 0 ] || set -- ha-lab run
exec "$@"
