#!/usr/bin/env bash
# Builds the local test images from Debian's packages, without a registry:
#   sqllock-ci/postgres:15      (postgresql-15)
#   sqllock-ci/mariadb:10.11    (mariadb-server mariadb-client)
# into the engine started by .ci/engine.sh. Each image directory holds
# image.conf (NAME, PACKAGES), optional pre-install.sh and setup.sh (run in the
# chroot before/after apt-get install), optional files/ (copied into the
# rootfs), entrypoint.sh and a Dockerfile with the image metadata.
#
# Steps: base rootfs (base.sh: debootstrap minbase, cached tarball) -> a copy
# per image -> chroot apt-get install --no-install-recommends -> clean ->
# `docker import` -> `docker build` of the metadata (ENV, ENTRYPOINT, CMD,
# STOPSIGNAL, which import cannot set) with label sqllock.ci.hash = content
# hash of .ci/images. Images whose label matches are not rebuilt.
#
# Usage: .ci/images/build.sh [--force]
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source=../lib.sh
. "$here/../lib.sh"

[ "$(id -u)" = 0 ] || ci_die "build.sh must run as root"
ci_docker version >/dev/null 2>&1 || ci_die "no engine on $SQLLOCK_CI_SOCK: run .ci/engine.sh start"

force=0
[ "${1:-}" = --force ] && force=1

hash=$(ci_hash "$here")
todo=()
for dir in "$here"/*/; do
	dir=${dir%/}
	[ -f "$dir/image.conf" ] || continue
	name=$(. "$dir/image.conf" && echo "$NAME")
	have=$(ci_docker image inspect -f '{{index .Config.Labels "sqllock.ci.hash"}}' "$name" 2>/dev/null || true)
	if [ "$force" = 0 ] && [ "$have" = "$hash" ]; then
		ci_log "image $name is up to date ($hash)"
	else
		todo+=("$dir")
	fi
done
[ ${#todo[@]} -gt 0 ] || exit 0

base=$("$here/base.sh")
work=$(mktemp -d /var/tmp/sqllock-ci-images.XXXXXX)
cleanup() {
	local m
	for m in "$work"/*/rootfs/proc; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	rm -rf "$work"
}
trap cleanup EXIT

build_one() {
	local dir=$1 NAME PACKAGES
	# shellcheck disable=SC1091
	. "$dir/image.conf"
	local root
	root=$work/$(basename "$dir")/rootfs
	mkdir -p "$root"
	tar -xf "$base" -C "$root"
	cp -L /etc/resolv.conf "$root/etc/resolv.conf"
	mount -t proc proc "$root/proc"
	local chr=(chroot "$root" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
		DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 HOME=/root)
	if [ -f "$dir/pre-install.sh" ]; then
		install -m 755 "$dir/pre-install.sh" "$root/tmp/pre-install.sh"
		"${chr[@]}" /tmp/pre-install.sh
	fi
	"${chr[@]}" apt-get update -qq
	# shellcheck disable=SC2086
	"${chr[@]}" apt-get install -y -qq --no-install-recommends $PACKAGES
	[ -d "$dir/files" ] && cp -a "$dir/files/." "$root/"
	install -m 755 "$dir/entrypoint.sh" "$root/usr/local/bin/docker-entrypoint.sh"
	if [ -f "$dir/setup.sh" ]; then
		install -m 755 "$dir/setup.sh" "$root/tmp/setup.sh"
		"${chr[@]}" /tmp/setup.sh
	fi
	"${chr[@]}" apt-get clean
	umount "$root/proc"
	rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
		"$root"/var/log/apt/* "$root"/var/log/dpkg.log "$root"/var/log/alternatives.log \
		"$root"/tmp/* "$root"/usr/share/man/* "$root"/usr/share/info/*
	find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
	: >"$root/etc/resolv.conf"

	local id
	id=$(tar --numeric-owner -C "$root" -c . | ci_docker import -m "sqllock-ci rootfs $hash" -)
	DOCKER_BUILDKIT=0 ci_docker build -q --build-arg "BASE=$id" --label "sqllock.ci.hash=$hash" \
		-t "$NAME" - <"$dir/Dockerfile" >/dev/null
	[ "$(ci_docker image inspect -f '{{index .Config.Labels "sqllock.ci.hash"}}' "$NAME")" = "$hash" ] ||
		ci_die "image $NAME was not built"
	ci_log "image $NAME built ($(ci_docker image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%d MB", $1/1e6}'))"
}

# Build the images in parallel, each logging to its own file.
pids=()
for dir in "${todo[@]}"; do
	ci_log "building image from $dir"
	build_one "$dir" >"$work/$(basename "$dir").log" 2>&1 &
	pids+=($!)
done
failed=0
for i in "${!todo[@]}"; do
	if ! wait "${pids[$i]}"; then
		failed=1
		echo "----- build log of ${todo[$i]} -----" >&2
		tail -n 60 "$work/$(basename "${todo[$i]}").log" >&2 || true
	else
		grep '^\[ci ' "$work/$(basename "${todo[$i]}").log" >&2 || true
	fi
done
[ "$failed" = 0 ] || ci_die "image build failed"
# Previous versions of the images are now dangling.
ci_docker image prune -f >/dev/null || true
