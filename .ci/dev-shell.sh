#!/usr/bin/env bash
# Usage: .ci/dev-shell.sh [--pair PG+MYSQL] [CMD...]
#
# Runs CMD (default: an interactive bash) inside the network namespace of the
# engine started by `.ci/engine.sh start`, with the environment the CI tests get:
#   DOCKER_HOST=unix://<engine socket>, TESTCONTAINERS_RYUK_DISABLED=true,
#   SQLLOCK_TEST_POSTGRES_IMAGE, SQLLOCK_TEST_MYSQL_IMAGE (the server pair),
#   CI=true, GOFLAGS+=-mod=mod, GOPROXY=off (the namespace has no network: run
#   `go mod download` outside first), SQLLOCK_TEST_*_DSN unset.
# The server pair, default sqllock-ci/postgres:15 + sqllock-ci/mariadb:10.11:
#   --pair postgres:18+mysql:9.7          (tags of sqllock-ci/ images), or
#   SQLLOCK_CI_PAIR=postgres:17+mariadb:11.8, or
#   SQLLOCK_CI_PG_IMAGE=... SQLLOCK_CI_MYSQL_IMAGE=...   (full references)
# The images must exist in the engine: .ci/images/build.sh [IMAGE...].
# The current directory is kept. Example:
#   .ci/engine.sh start && .ci/images/build.sh && .ci/dev-shell.sh go test ./...
#   .ci/dev-shell.sh --pair postgres:18+mysql:9.7 go test ./advisory/
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$(readlink -f "$0")")/lib.sh"

pair=${SQLLOCK_CI_PAIR:-}
if [ "${1:-}" = --pair ]; then
	[ $# -ge 2 ] || ci_die "usage: dev-shell.sh [--pair PG+MYSQL] [CMD...]"
	pair=$2
	shift 2
fi
if [ -n "$pair" ]; then
	ci_pair_split "$pair" >/dev/null # dies on a malformed pair
	{ read -r SQLLOCK_CI_PG_IMAGE; read -r SQLLOCK_CI_MYSQL_IMAGE; } < <(ci_pair_split "$pair")
fi

ci_load_state || ci_die "engine not running: run .ci/engine.sh start"
kill -0 "$SQLLOCK_CI_NETNS_PID" 2>/dev/null || ci_die "engine pid $SQLLOCK_CI_NETNS_PID is gone: run .ci/engine.sh start"

for img in "$SQLLOCK_CI_PG_IMAGE" "$SQLLOCK_CI_MYSQL_IMAGE"; do
	ci_docker image inspect "$img" >/dev/null 2>&1 ||
		ci_log "warning: image $img is not in the engine (build it: .ci/images/build.sh $img)"
done

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
