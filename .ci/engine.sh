#!/usr/bin/env bash
# Private Docker engine for the sqllock tests, from Debian's packages.
#
#   .ci/engine.sh start    install (cached) and start dockerd in its own network
#                          namespace; idempotent; prints the state file
#   .ci/engine.sh stop     remove containers, stop dockerd/containerd by PID and
#                          clean up everything start created (images are kept)
#   .ci/engine.sh status   exit 0 if the engine runs and answers
#   .ci/engine.sh env      print the state as `export` lines (eval "$(... env)")
#
# The engine: dockerd 20.10 + containerd + runc unpacked (dpkg -x) from Debian's
# docker.io/containerd/runc into $SQLLOCK_CI_CACHE/engine, started under
# `unshare -n` with no iptables, data-root $SQLLOCK_CI_DATA (persistent, keeps
# the images), exec-root and socket under $SQLLOCK_CI_RUN. Published ports live
# in that namespace: run clients there, e.g. `.ci/dev-shell.sh go test ./...`
# or `nsenter --net=/proc/$SQLLOCK_CI_NETNS_PID/ns/net CMD`.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$(readlink -f "$0")")/lib.sh"

[ "$(id -u)" = 0 ] || ci_die "engine.sh must run as root"

EXEC_ROOT=$SQLLOCK_CI_RUN/exec
PIDFILE=$SQLLOCK_CI_RUN/dockerd.pid
LOG=$SQLLOCK_CI_RUN/dockerd.log

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# comm_is PID NAME: the process PID runs a binary called NAME (guards against
# PID reuse before we signal a PID read from a file).
comm_is() { [ "$(cat "/proc/$1/comm" 2>/dev/null || true)" = "$2" ]; }

install_engine() {
	if [ -x "$SQLLOCK_CI_ENGINE/root/usr/sbin/dockerd" ] && [ -f "$SQLLOCK_CI_ENGINE/.complete" ]; then
		return 0
	fi
	ci_apt_update
	ci_log "downloading docker.io containerd runc from Debian"
	rm -rf "$SQLLOCK_CI_ENGINE"
	mkdir -p "$SQLLOCK_CI_ENGINE/debs"
	# apt drops privileges to _apt for downloads; let it write there.
	chown _apt "$SQLLOCK_CI_ENGINE/debs" 2>/dev/null || true
	(cd "$SQLLOCK_CI_ENGINE/debs" && apt-get download -qq docker.io containerd runc >&2) ||
		ci_die "apt-get download docker.io containerd runc failed"
	local deb
	for deb in "$SQLLOCK_CI_ENGINE"/debs/*.deb; do
		dpkg -x "$deb" "$SQLLOCK_CI_ENGINE/root" || ci_die "dpkg -x $deb failed"
	done
	local b
	for b in usr/sbin/dockerd usr/sbin/docker-proxy usr/sbin/runc usr/bin/containerd usr/bin/containerd-shim-runc-v2; do
		[ -x "$SQLLOCK_CI_ENGINE/root/$b" ] || ci_die "$b missing from the unpacked packages"
	done
	ls "$SQLLOCK_CI_ENGINE"/debs >"$SQLLOCK_CI_ENGINE/.complete"
	rm -f "$SQLLOCK_CI_ENGINE"/debs/*.deb
}

healthy() {
	ci_load_state 2>/dev/null || return 1
	alive "${SQLLOCK_CI_DOCKERD_PID:-}" && comm_is "$SQLLOCK_CI_DOCKERD_PID" dockerd || return 1
	timeout 10 env DOCKER_HOST="unix://$SQLLOCK_CI_SOCK" "$(command -v docker || echo "$SQLLOCK_CI_ENGINE/root/usr/bin/docker")" \
		version >/dev/null 2>&1
}

cgroup_docker_dirs() {
	local d
	for d in /sys/fs/cgroup/*/docker /sys/fs/cgroup/docker; do
		[ -d "$d" ] && echo "$d"
	done
	return 0
}

cmd_start() {
	if healthy; then
		ci_log "engine already running (dockerd pid $SQLLOCK_CI_DOCKERD_PID)"
		cat "$SQLLOCK_CI_STATE"
		return 0
	fi
	if [ -e "$SQLLOCK_CI_RUN" ]; then
		ci_log "cleaning up a stale engine state in $SQLLOCK_CI_RUN"
		cmd_stop
	fi
	install_engine

	local created_etc=0 pre_cgroups
	[ -e /etc/docker ] || created_etc=1
	pre_cgroups=$(cgroup_docker_dirs)

	mkdir -p "$SQLLOCK_CI_RUN" "$EXEC_ROOT" "$SQLLOCK_CI_DATA"
	chmod 700 "$SQLLOCK_CI_RUN"
	# Record what we may create before anything exists, so that stop can undo it
	# even if dockerd dies half-way.
	{
		echo "SQLLOCK_CI_CREATED_ETC_DOCKER=$created_etc"
		echo "SQLLOCK_CI_PRE_CGROUPS='$(echo "$pre_cgroups" | tr '\n' ' ')'"
	} >"$SQLLOCK_CI_RUN/pre.env"

	ci_log "starting dockerd in a new network namespace (log: $LOG)"
	local eng=$SQLLOCK_CI_ENGINE/root
	# setsid: the engine outlives this script (developer use) and is not hit by
	# the caller's terminal signals. unshare -n + exec keep the PID: the dockerd
	# PID is also the network namespace's PID.
	PATH="$eng/usr/sbin:$eng/usr/bin:$PATH" setsid unshare -n sh -c 'ip link set lo up && exec "$@"' sh \
		dockerd \
		--data-root "$SQLLOCK_CI_DATA" \
		--exec-root "$EXEC_ROOT" \
		--pidfile "$PIDFILE" \
		-H "unix://$SQLLOCK_CI_SOCK" \
		--iptables=false --ip6tables=false --ip-masq=false \
		--userland-proxy=true --userland-proxy-path "$eng/usr/sbin/docker-proxy" \
		</dev/null >"$LOG" 2>&1 &
	local launcher=$! pid="" _
	for _ in $(seq 1 600); do
		if [ -s "$PIDFILE" ] && [ -S "$SQLLOCK_CI_SOCK" ]; then
			pid=$(cat "$PIDFILE")
			if DOCKER_HOST="unix://$SQLLOCK_CI_SOCK" timeout 5 \
				"$(command -v docker || echo "$eng/usr/bin/docker")" version >/dev/null 2>&1; then
				break
			fi
		fi
		if ! alive "$launcher" && { [ -z "$pid" ] || ! alive "$pid"; }; then
			tail -n 40 "$LOG" >&2 || true
			ci_die "dockerd exited during startup"
		fi
		pid=""
		sleep 0.1
	done
	if [ -z "$pid" ]; then
		tail -n 40 "$LOG" >&2 || true
		ci_die "dockerd did not answer on $SQLLOCK_CI_SOCK within 60 s"
	fi
	local ino
	ino=$(stat -L -c %i "/proc/$pid/ns/net")
	[ "$ino" != "$(stat -L -c %i /proc/self/ns/net)" ] || ci_die "dockerd is not in its own network namespace"
	{
		cat "$SQLLOCK_CI_RUN/pre.env"
		echo "SQLLOCK_CI_DOCKERD_PID=$pid"
		echo "SQLLOCK_CI_NETNS_PID=$pid"
		echo "SQLLOCK_CI_NETNS_INODE=$ino"
		echo "SQLLOCK_CI_SOCK=$SQLLOCK_CI_SOCK"
		echo "DOCKER_HOST=unix://$SQLLOCK_CI_SOCK"
	} >"$SQLLOCK_CI_STATE.tmp"
	mv "$SQLLOCK_CI_STATE.tmp" "$SQLLOCK_CI_STATE"

	# Containers left by an earlier run that died (data-root is persistent).
	local old
	old=$(ci_docker ps -aq)
	if [ -n "$old" ]; then
		ci_log "removing $(echo "$old" | wc -l) leftover container(s)"
		# shellcheck disable=SC2086
		ci_docker rm -f $old >/dev/null
	fi
	ci_log "engine up: dockerd pid $pid, $(ci_docker version -f 'server {{.Server.Version}} API {{.Server.APIVersion}}')"
	cat "$SQLLOCK_CI_STATE"
}

# kill_pids SIGNAL PID...: signal each PID that still exists.
kill_pids() {
	local sig=$1 p
	shift
	for p in "$@"; do
		kill "-$sig" "$p" 2>/dev/null || true
	done
}

# wait_gone SECONDS PID...: wait until none of the PIDs exists.
wait_gone() {
	local n=$(($1 * 10)) p any
	shift
	while [ "$n" -gt 0 ]; do
		any=0
		for p in "$@"; do alive "$p" && any=1; done
		[ "$any" = 0 ] && return 0
		sleep 0.1
		n=$((n - 1))
	done
	return 1
}

# netns_pids INODE: processes whose network namespace is ours (containerd, shims,
# docker-proxy, anything nsenter'd there), except ourselves.
netns_pids() {
	local ino=$1 d p
	for d in /proc/[0-9]*; do
		p=${d#/proc/}
		[ "$p" = $$ ] && continue
		[ "$(stat -L -c %i "$d/ns/net" 2>/dev/null || true)" = "$ino" ] && echo "$p"
	done
	return 0
}

cmd_stop() {
	SQLLOCK_CI_DOCKERD_PID="" SQLLOCK_CI_NETNS_INODE="" SQLLOCK_CI_CREATED_ETC_DOCKER=0 SQLLOCK_CI_PRE_CGROUPS=""
	[ -f "$SQLLOCK_CI_RUN/pre.env" ] && . "$SQLLOCK_CI_RUN/pre.env"
	ci_load_state 2>/dev/null || true
	local pid=${SQLLOCK_CI_DOCKERD_PID:-}
	[ -n "$pid" ] || { [ -s "$PIDFILE" ] && pid=$(cat "$PIDFILE"); } || true
	if [ -n "$pid" ] && alive "$pid" && comm_is "$pid" dockerd; then
		local ids
		ids=$(timeout 20 env DOCKER_HOST="unix://$SQLLOCK_CI_SOCK" "$(command -v docker || echo "$SQLLOCK_CI_ENGINE/root/usr/bin/docker")" ps -aq 2>/dev/null || true)
		if [ -n "$ids" ]; then
			ci_log "removing $(echo "$ids" | wc -l) container(s)"
			# shellcheck disable=SC2086
			timeout 60 env DOCKER_HOST="unix://$SQLLOCK_CI_SOCK" "$(command -v docker || echo "$SQLLOCK_CI_ENGINE/root/usr/bin/docker")" rm -f $ids >/dev/null 2>&1 || true
		fi
		ci_log "stopping dockerd (pid $pid)"
		kill_pids TERM "$pid"
		if ! wait_gone 30 "$pid"; then
			ci_log "dockerd did not stop in 30 s: killing it"
			kill_pids KILL "$pid"
			wait_gone 5 "$pid" || true
		fi
	fi
	# containerd started by dockerd normally exits with it; make sure.
	local cpid
	cpid=$(cat "$EXEC_ROOT/containerd/containerd.pid" 2>/dev/null || true)
	if [ -n "$cpid" ] && alive "$cpid" && comm_is "$cpid" containerd; then
		kill_pids TERM "$cpid"
		wait_gone 10 "$cpid" || kill_pids KILL "$cpid"
	fi
	# Anything else left in the engine's network namespace (shims, docker-proxy).
	if [ -n "${SQLLOCK_CI_NETNS_INODE:-}" ]; then
		local left
		left=$(netns_pids "$SQLLOCK_CI_NETNS_INODE")
		if [ -n "$left" ]; then
			ci_log "stopping leftover processes in the engine's netns: $(echo "$left" | tr '\n' ' ')"
			# shellcheck disable=SC2086
			kill_pids TERM $left
			# shellcheck disable=SC2086
			wait_gone 5 $left || kill_pids KILL $left
		fi
	fi
	# Container processes that outlived their shim, in the cgroups dockerd made.
	local cg pre=" ${SQLLOCK_CI_PRE_CGROUPS:-} "
	for cg in $(cgroup_docker_dirs); do
		case $pre in *" $cg "*) continue ;; esac
		local procs
		procs=$(cat "$cg"/*/cgroup.procs 2>/dev/null || true)
		# shellcheck disable=SC2086
		[ -n "$procs" ] && { kill_pids KILL $procs; wait_gone 5 $procs || true; }
	done
	# Mounts left under our directories (overlays, netns files) if dockerd died.
	local m
	for m in $(awk -v a="$SQLLOCK_CI_RUN" -v b="$SQLLOCK_CI_DATA" \
		'index($5, a"/") == 1 || index($5, b"/") == 1 {print $5}' /proc/self/mountinfo | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	# dockerd bind-mounts its data-root onto itself (for mount propagation) and
	# leaves this marker; it undoes both on a clean exit, not when killed.
	if [ -e "$EXEC_ROOT/unmount-on-shutdown" ] && mountpoint -q "$SQLLOCK_CI_DATA"; then
		umount -l "$SQLLOCK_CI_DATA" 2>/dev/null || true
	fi
	rm -rf "$SQLLOCK_CI_RUN"
	if [ "${SQLLOCK_CI_CREATED_ETC_DOCKER:-0}" = 1 ] && [ -d /etc/docker ]; then
		rm -rf /etc/docker
	fi
	for cg in $(cgroup_docker_dirs); do
		case $pre in *" $cg "*) continue ;; esac
		find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
		[ -d "$cg" ] && ci_log "warning: could not remove $cg"
	done
	ci_log "engine stopped and cleaned up"
}

cmd_env() {
	healthy || ci_die "engine not running: run .ci/engine.sh start"
	sed 's/^/export /' "$SQLLOCK_CI_STATE"
}

case ${1:-} in
start) cmd_start ;;
stop) cmd_stop ;;
status)
	if healthy; then
		ci_log "engine running (dockerd pid $SQLLOCK_CI_DOCKERD_PID, socket $SQLLOCK_CI_SOCK)"
	else
		ci_log "engine not running"
		exit 1
	fi
	;;
env) cmd_env ;;
*) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
