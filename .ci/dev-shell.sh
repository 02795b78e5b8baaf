#!/usr/bin/env bash
# Runs CMD (default: an interactive bash) inside the network namespace of the
# engine started by `.ci/engine.sh start`, with the environment the CI tests get:
#   DOCKER_HOST=unix://<engine socket>, TESTCONTAINERS_RYUK_DISABLED=true,
#   SQLLOCK_TEST_POSTGRES_IMAGE=sqllock-ci/postgres:15,
#   SQLLOCK_TEST_MYSQL_IMAGE=sqllock-ci/mariadb:10.11, CI=true,
#   GOFLAGS+=-mod=mod, GOPROXY=off (the namespace has no network: run
#   `go mod download` outside first), SQLLOCK_TEST_*_DSN unset.
# The current directory is kept. Example:
#   .ci/engine.sh start && .ci/images/build.sh && .ci/dev-shell.sh go test ./...
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$(readlink -f "$0")")/lib.sh"

ci_load_state || ci_die "engine not running: run .ci/engine.sh start"
kill -0 "$SQLLOCK_CI_NETNS_PID" 2>/dev/null || ci_die "engine pid $SQLLOCK_CI_NETNS_PID is gone: run .ci/engine.sh start"

[ $# -gt 0 ] || set -- bash -i

# Keep the GOFLAGS in force (environment or `go env -w`), with -mod=mod.
goflags=""
for f in $(go env GOFLAGS 2>/dev/null || true); do
	case $f in -mod=*) ;; *) goflags="$goflags$f " ;; esac
done
goflags="$goflags-mod=mod"

exec nsenter --net="/proc/$SQLLOCK_CI_NETNS_PID/ns/net" -- \
	env -u SQLLOCK_TEST_POSTGRES_DSN -u SQLLOCK_TEST_MYSQL_DSN \
	DOCKER_HOST="unix://$SQLLOCK_CI_SOCK" \
	TESTCONTAINERS_RYUK_DISABLED=true \
	SQLLOCK_TEST_POSTGRES_IMAGE="$SQLLOCK_CI_PG_IMAGE" \
	SQLLOCK_TEST_MYSQL_IMAGE="$SQLLOCK_CI_MYSQL_IMAGE" \
	CI=true \
	GOFLAGS="$goflags" \
	GOPROXY=off \
	"$@"
