# shellcheck shell=bash
# Shared settings and helpers for the .ci scripts. Source it; do not run it.
#
# Paths (all overridable from the environment):
#   SQLLOCK_CI_CACHE  persistent cache: unpacked engine, base rootfs tarball
#   SQLLOCK_CI_DATA   dockerd --data-root, persistent so built images survive reruns
#   SQLLOCK_CI_RUN    runtime dir: socket, exec-root, pid files, logs, state file
#                     (removed by `engine.sh stop`)

SQLLOCK_CI_CACHE=${SQLLOCK_CI_CACHE:-/var/cache/sqllock-ci}
SQLLOCK_CI_DATA=${SQLLOCK_CI_DATA:-/var/lib/sqllock-ci-docker}
SQLLOCK_CI_RUN=${SQLLOCK_CI_RUN:-/run/sqllock-ci}
SQLLOCK_CI_SOCK=$SQLLOCK_CI_RUN/docker.sock
SQLLOCK_CI_STATE=$SQLLOCK_CI_RUN/engine.env
SQLLOCK_CI_ENGINE=$SQLLOCK_CI_CACHE/engine

# The server matrix of .ci/run: pairs PG+MYSQL of image tags (short for
# sqllock-ci/TAG), one `go test ./...` run per pair, so that every server runs
# every package. Override to run a subset, e.g. SQLLOCK_CI_MATRIX=postgres:18+mysql:9.7.
SQLLOCK_CI_MATRIX=${SQLLOCK_CI_MATRIX:-postgres:15+mariadb:10.11 postgres:17+mariadb:11.8 postgres:18+mysql:9.7}

# The pair .ci/dev-shell.sh gives the tests (full image references).
SQLLOCK_CI_PG_IMAGE=${SQLLOCK_CI_PG_IMAGE:-sqllock-ci/postgres:15}
SQLLOCK_CI_MYSQL_IMAGE=${SQLLOCK_CI_MYSQL_IMAGE:-sqllock-ci/mariadb:10.11}

ci_log() { printf '[ci %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
ci_die() { printf '[ci %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

# ci_docker ARGS...: the docker CLI against our engine's socket. Prefers the
# machine's CLI (newer), falls back to the one unpacked from docker.io.
ci_docker() {
	local cli
	cli=$(command -v docker 2>/dev/null || true)
	[ -n "$cli" ] || cli=$SQLLOCK_CI_ENGINE/root/usr/bin/docker
	DOCKER_HOST=unix://$SQLLOCK_CI_SOCK "$cli" "$@"
}

# ci_apt_update: `apt-get update` at most once per process tree.
ci_apt_update() {
	if [ "${SQLLOCK_CI_APT_UPDATED:-}" != 1 ]; then
		ci_log "apt-get update"
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || ci_die "apt-get update failed"
		export SQLLOCK_CI_APT_UPDATED=1
	fi
}

# ci_need_cmd CMD PACKAGE: install PACKAGE from Debian if CMD is missing. Callers
# that run at once (the image builds of several suites) take turns: apt's own lock
# would make all but one fail.
ci_need_cmd() {
	command -v "$1" >/dev/null 2>&1 && return 0
	(
		flock 8
		command -v "$1" >/dev/null 2>&1 && exit 0 # installed while we waited
		ci_apt_update
		ci_log "installing $2"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >&2 ||
			ci_die "apt-get install $2 failed"
	) 8>/var/lock/sqllock-ci-apt.lock || exit 1
	command -v "$1" >/dev/null 2>&1 || ci_die "$1 still missing after installing $2"
}

# ci_load_state: source the engine state file (SQLLOCK_CI_DOCKERD_PID, ...).
ci_load_state() {
	[ -f "$SQLLOCK_CI_STATE" ] || return 1
	# shellcheck disable=SC1090
	. "$SQLLOCK_CI_STATE"
}

# ci_debian_uri SUITE: the first archive URI the machine's apt sources use for
# SUITE (deb822 *.sources or one-line *.list), or nothing.
ci_debian_uri() {
	local suite=$1 f
	{
		for f in /etc/apt/sources.list.d/*.sources; do
			[ -f "$f" ] || continue
			awk -v s="$suite" '
				function flush() {
					if (enabled != "no" && types ~ /(^|[ \t])deb([ \t]|$)/ && (" " suites " ") ~ ("[ \t]" s "[ \t]") && uris != "") {
						split(uris, u, " "); print u[1]
					}
					types = ""; uris = ""; suites = ""; enabled = ""
				}
				/^[ \t]*#/ { next }
				/^[ \t]*$/ { flush(); next }
				{ k = tolower($1); v = substr($0, index($0, ":") + 1); gsub(/^[ \t]+|[ \t]+$/, "", v) }
				k == "types:" { types = v }
				k == "uris:" { uris = v }
				k == "suites:" { suites = v }
				k == "enabled:" { enabled = tolower(v) }
				END { flush() }' "$f"
		done
		for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
			[ -f "$f" ] || continue
			awk -v s="$suite" '$1 == "deb" {
				i = 2
				if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
				if ($(i + 1) == s) print $i
			}' "$f"
		done
	} | head -n 1
}

# ci_image_ref REF: REF with the sqllock-ci/ repository added when it has none
# (postgres:17 -> sqllock-ci/postgres:17).
ci_image_ref() {
	case $1 in
	*/*) printf '%s\n' "$1" ;;
	*) printf 'sqllock-ci/%s\n' "$1" ;;
	esac
}

# ci_pair_split PAIR: print the two full image references of PG+MYSQL, one a line.
ci_pair_split() {
	case $1 in
	?*+?*) ;;
	*) ci_die "bad server pair '$1': want PG+MYSQL, e.g. postgres:17+mariadb:11.8" ;;
	esac
	ci_image_ref "${1%%+*}"
	ci_image_ref "${1#*+}"
}
