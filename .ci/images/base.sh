#!/usr/bin/env bash
# Usage: .ci/images/base.sh SUITE   (bookworm, trixie, sid, ...)
#
# Prints the path of a tarball of a minimal Debian SUITE rootfs (debootstrap
# --variant=minbase), configured for non-interactive apt inside a chroot.
# Cached as $SQLLOCK_CI_CACHE/base-SUITE-KEY.tar, KEY = hash of this script,
# the suite and its mirrors; built (about 30-60 s) when missing. One base per
# suite; building a new one deletes that suite's older ones. Concurrent calls
# for the same suite wait for each other (flock).
#
# Mirror: the archive URI the machine's apt uses for SUITE, else the one it uses
# for its own release (the same archive serves every suite), else
# deb.debian.org. Security updates (SUITE-security) and SUITE-updates are added
# for stable releases, not for sid.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source=../lib.sh
. "$here/../lib.sh"

SUITE=${1:-}
[ -n "$SUITE" ] || ci_die "usage: base.sh SUITE"
case $SUITE in
*[!a-z0-9-]*) ci_die "base.sh: bad suite name '$SUITE'" ;;
esac
host_suite=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
MIRROR=$(ci_debian_uri "$SUITE")
[ -n "$MIRROR" ] || [ -z "$host_suite" ] || MIRROR=$(ci_debian_uri "$host_suite")
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=""
case $SUITE in
sid | unstable | experimental) ;;
*)
	SECURITY=$(ci_debian_uri "$SUITE-security")
	[ -n "$SECURITY" ] || [ -z "$host_suite" ] || SECURITY=$(ci_debian_uri "$host_suite-security")
	SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
	;;
esac

key=$({ cat "$0"; echo "$SUITE $MIRROR $SECURITY"; } | sha256sum | cut -c1-16)
out=$SQLLOCK_CI_CACHE/base-$SUITE-$key.tar
mkdir -p "$SQLLOCK_CI_CACHE"
exec 9>"$SQLLOCK_CI_CACHE/.base-$SUITE.lock"
flock 9
if [ -s "$out" ]; then
	ci_log "base rootfs $SUITE: cached $out"
	echo "$out"
	exit 0
fi

ci_need_cmd debootstrap debootstrap
[ -e "/usr/share/debootstrap/scripts/$SUITE" ] ||
	ci_die "this debootstrap does not know $SUITE (upgrade the debootstrap package)"
tmp=$(mktemp -d /var/tmp/sqllock-ci-base.XXXXXX)
cleanup() {
	umount -l "$tmp/root/proc" 2>/dev/null || true
	rm -rf "$tmp" "$out.tmp"
}
trap cleanup EXIT
root=$tmp/root

t0=$(date +%s)
ci_log "debootstrap --variant=minbase $SUITE from $MIRROR"
if ! debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$tmp/debootstrap.log" 2>&1; then
	tail -n 30 "$tmp/debootstrap.log" >&2
	tail -n 30 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null || true
	ci_die "debootstrap $SUITE failed"
fi

{
	echo "deb $MIRROR $SUITE main"
	if [ -n "$SECURITY" ]; then
		echo "deb $MIRROR $SUITE-updates main"
		echo "deb $SECURITY $SUITE-security main"
	fi
} >"$root/etc/apt/sources.list"
# Newer suites ship a deb822 debian.sources; sources.list is the only source.
rm -f "$root"/etc/apt/sources.list.d/*.sources "$root"/etc/apt/sources.list.d/*.list
# Services must not start inside the chroot.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
# Check-Valid-Until: sid's (and a snapshot's) Release file may read as expired
# by the machine's clock, and apt-get update then fails.
cat >"$root/etc/apt/apt.conf.d/90sqllock-ci" <<'APT'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Check-Valid-Until "false";
Acquire::Languages "none";
APT
cat >"$root/etc/dpkg/dpkg.cfg.d/90sqllock-ci" <<'DPKG'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
DPKG
# mariadb-install-db and mysqld --initialize fail without /etc/hosts.
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/debootstrap \
	"$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* 2>/dev/null || true
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true

tar --numeric-owner -C "$root" -cf "$out.tmp" .
mv "$out.tmp" "$out"
# Older bases of this suite (other keys) are of no further use.
find "$SQLLOCK_CI_CACHE" -maxdepth 1 -name "base-$SUITE-????????????????.tar" ! -path "$out" -delete
ci_log "base rootfs $SUITE: built $out ($(du -h "$out" | cut -f1), $(($(date +%s) - t0)) s)"
echo "$out"
