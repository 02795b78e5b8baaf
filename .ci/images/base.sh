#!/usr/bin/env bash
# Prints the path of a tarball of a minimal Debian bookworm rootfs (debootstrap
# --variant=minbase), configured for non-interactive apt inside a chroot.
# Cached as $SQLLOCK_CI_CACHE/base-bookworm-KEY.tar, KEY = hash of this script
# and the mirrors; built (about 30-60 s) when missing.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source=../lib.sh
. "$here/../lib.sh"

SUITE=bookworm
MIRROR=$(ci_debian_uri "$SUITE")
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=$(ci_debian_uri "$SUITE-security")
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}

key=$({ cat "$0"; echo "$SUITE $MIRROR $SECURITY"; } | sha256sum | cut -c1-16)
out=$SQLLOCK_CI_CACHE/base-$SUITE-$key.tar
if [ -s "$out" ]; then
	ci_log "base rootfs: cached $out"
	echo "$out"
	exit 0
fi

ci_need_cmd debootstrap debootstrap
mkdir -p "$SQLLOCK_CI_CACHE"
tmp=$(mktemp -d /var/tmp/sqllock-ci-base.XXXXXX)
cleanup() {
	umount -l "$tmp/root/proc" 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT
root=$tmp/root

ci_log "debootstrap --variant=minbase $SUITE from $MIRROR"
if ! debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$tmp/debootstrap.log" 2>&1; then
	tail -n 30 "$tmp/debootstrap.log" >&2
	tail -n 30 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null || true
	ci_die "debootstrap failed"
fi

cat >"$root/etc/apt/sources.list" <<SRC
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
SRC
# Services must not start inside the chroot.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
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
# mariadb-install-db fails without /etc/hosts.
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/debootstrap \
	"$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* 2>/dev/null || true
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true

tar --numeric-owner -C "$root" -cf "$out.tmp" .
mv "$out.tmp" "$out"
# Older bases (other keys) are of no further use.
find "$SQLLOCK_CI_CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" ! -path "$out" -delete
ci_log "base rootfs: built $out ($(du -h "$out" | cut -f1))"
echo "$out"
