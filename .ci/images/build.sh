#!/usr/bin/env bash
# Builds the local test images from Debian's packages, without a registry, into
# the engine started by .ci/engine.sh:
#
#   sqllock-ci/postgres:15    bookworm  postgresql-15
#   sqllock-ci/postgres:17    trixie    postgresql-17
#   sqllock-ci/postgres:18    sid       postgresql-18
#   sqllock-ci/mariadb:10.11  bookworm  mariadb-server mariadb-client
#   sqllock-ci/mariadb:11.8   trixie    mariadb-server mariadb-client
#   sqllock-ci/mysql:9.7      sid       mysql-server (Oracle MySQL)
#
# Layout: one directory per server kind (postgres/, mariadb/, mysql/) holds the
# recipe its images share: entrypoint.sh, a Dockerfile with the image metadata,
# optional pre-install.sh and setup.sh (run in the chroot before/after apt-get
# install, with VERSION, SUITE and NAME in their environment) and optional files/
# (copied into the rootfs). Each TAG.conf next to them defines one image: NAME,
# SUITE (the Debian suite of its packages), VERSION (given to the scripts and to
# the Dockerfile as build-arg VERSION) and PACKAGES.
#
# Steps per image: base rootfs of its suite (base.sh: debootstrap minbase,
# cached tarball, one per suite) -> a copy -> chroot apt-get upgrade + install
# --no-install-recommends -> clean -> `docker import` -> `docker build` of the
# metadata (ENV, ENTRYPOINT, CMD, STOPSIGNAL, which import cannot set) with
# labels sqllock.ci.hash (content hash of base.sh, build.sh, the kind's
# directory without the other images' .conf files, and the image's .conf),
# sqllock.ci.suite and sqllock.ci.packages (installed package versions).
# Images whose hash label matches are not rebuilt. Bases, then images, are
# built in parallel, each logging to its own file (shown when it fails).
#
# Usage: .ci/images/build.sh [--force] [--list] [IMAGE...]
#   IMAGE    build only these (sqllock-ci/postgres:17 or postgres:17); default all
#   --force  rebuild even when up to date
#   --list   print the defined images (NAME SUITE conf) and exit
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source=../lib.sh
. "$here/../lib.sh"

force=0 list=0 want=()
for a in "$@"; do
	case $a in
	--force) force=1 ;;
	--list) list=1 ;;
	-*) ci_die "usage: build.sh [--force] [--list] [IMAGE...]" ;;
	*) want+=("$(ci_image_ref "$a")") ;;
	esac
done

# conf_get CONF VAR: VAR of an image definition.
conf_get() {
	(
		NAME="" SUITE="" VERSION="" PACKAGES=""
		# shellcheck disable=SC1090
		. "$1"
		printf '%s' "${!2}"
	)
}

# image_hash CONF: content hash of everything the image is built from.
image_hash() {
	local conf=$1 kind
	kind=$(dirname "$conf")
	{
		sha256sum "$here/base.sh" "$here/build.sh" | cut -d' ' -f1
		# The kind's files except the image definitions (TAG.conf at its top).
		(cd "$kind" && find . -type f ! -name '*~' ! -name '.*.swp' ! -regex '\./[^/]*\.conf' -print0 |
			LC_ALL=C sort -z | xargs -0 sha256sum)
		echo "conf $(basename "$conf")"
		cat "$conf"
	} | sha256sum | cut -c1-16
}

confs=()
for conf in "$here"/*/*.conf; do
	[ -f "$conf" ] && confs+=("$conf")
done
[ ${#confs[@]} -gt 0 ] || ci_die "no image definitions under $here/*/*.conf"

if [ "$list" = 1 ]; then
	for conf in "${confs[@]}"; do
		printf '%-26s %-9s %s\n' "$(conf_get "$conf" NAME)" "$(conf_get "$conf" SUITE)" "${conf#"$here"/}"
	done
	exit 0
fi

[ "$(id -u)" = 0 ] || ci_die "build.sh must run as root"
ci_docker version >/dev/null 2>&1 || ci_die "no engine on $SQLLOCK_CI_SOCK: run .ci/engine.sh start"

# The images to consider.
sel=()
for conf in "${confs[@]}"; do
	name=$(conf_get "$conf" NAME)
	[ -n "$name" ] && [ -n "$(conf_get "$conf" SUITE)" ] && [ -n "$(conf_get "$conf" PACKAGES)" ] ||
		ci_die "$conf: NAME, SUITE and PACKAGES must be set"
	if [ ${#want[@]} -gt 0 ]; then
		case " ${want[*]} " in *" $name "*) ;; *) continue ;; esac
	fi
	sel+=("$conf")
done
for w in "${want[@]}"; do
	found=0
	for conf in "${sel[@]}"; do [ "$(conf_get "$conf" NAME)" = "$w" ] && found=1; done
	[ "$found" = 1 ] || ci_die "no image definition for $w (defined: $("$0" --list | awk '{print $1}' | tr '\n' ' '))"
done

todo=() hashes=()
for conf in "${sel[@]}"; do
	name=$(conf_get "$conf" NAME)
	hash=$(image_hash "$conf")
	have=$(ci_docker image inspect -f '{{index .Config.Labels "sqllock.ci.hash"}}' "$name" 2>/dev/null || true)
	if [ "$force" = 0 ] && [ "$have" = "$hash" ]; then
		ci_log "image $name is up to date ($hash)"
	else
		todo+=("$conf")
		hashes+=("$hash")
	fi
done
[ ${#todo[@]} -gt 0 ] || exit 0

work=$(mktemp -d /var/tmp/sqllock-ci-images.XXXXXX)
cleanup() {
	local m
	for m in "$work"/*/rootfs/proc; do
		mountpoint -q "$m" 2>/dev/null && umount -l "$m"
	done
	rm -rf "$work"
}
trap cleanup EXIT

# wait_all LABEL LOGDIR NAME... : wait for the background jobs in pids[] (one
# per NAME); on failure show the tail of LOGDIR/NAME.log.
wait_all() {
	local label=$1 logdir=$2 i failed=0
	shift 2
	local names=("$@")
	for i in "${!pids[@]}"; do
		if ! wait "${pids[$i]}"; then
			failed=1
			echo "----- $label log of ${names[$i]} -----" >&2
			tail -n 60 "$logdir/${names[$i]}.log" >&2 || true
		else
			grep '^\[ci ' "$logdir/${names[$i]}.log" >&2 || true
		fi
	done
	return "$failed"
}

# Base rootfs of each suite needed, in parallel.
suites=()
for conf in "${todo[@]}"; do
	s=$(conf_get "$conf" SUITE)
	case " ${suites[*]} " in *" $s "*) ;; *) suites+=("$s") ;; esac
done
mkdir -p "$work/base"
pids=()
for s in "${suites[@]}"; do
	"$here/base.sh" "$s" >"$work/base/$s.path" 2>"$work/base/$s.log" &
	pids+=($!)
done
wait_all base "$work/base" "${suites[@]}" || ci_die "building a base rootfs failed"

build_one() {
	local conf=$1 hash=$2 dir NAME SUITE VERSION PACKAGES
	dir=$(dirname "$conf")
	NAME=$(conf_get "$conf" NAME)
	SUITE=$(conf_get "$conf" SUITE)
	VERSION=$(conf_get "$conf" VERSION)
	PACKAGES=$(conf_get "$conf" PACKAGES)
	local base t0 root
	t0=$(date +%s)
	base=$(cat "$work/base/$SUITE.path")
	root=$work/$(basename "$dir")-$(basename "$conf" .conf)/rootfs
	mkdir -p "$root"
	tar -xf "$base" -C "$root"
	cp -L /etc/resolv.conf "$root/etc/resolv.conf"
	mount -t proc proc "$root/proc"
	local chr=(chroot "$root" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
		DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 HOME=/root
		NAME="$NAME" SUITE="$SUITE" VERSION="$VERSION")
	if [ -f "$dir/pre-install.sh" ]; then
		install -m 755 "$dir/pre-install.sh" "$root/tmp/pre-install.sh"
		"${chr[@]}" /tmp/pre-install.sh
	fi
	"${chr[@]}" apt-get update -qq
	# The cached base may be older than the suite (sid moves daily).
	"${chr[@]}" apt-get upgrade -y -qq
	# Downloaded with the host's network, installed in a network namespace of its own:
	# a package script that looks for a free port (mysql-server's postinst gives up
	# when 3306 and 3307 are both taken) must not see the build host's servers.
	# shellcheck disable=SC2086
	"${chr[@]}" apt-get install -y -qq --no-install-recommends --download-only $PACKAGES
	# shellcheck disable=SC2086
	unshare --net "${chr[@]}" apt-get install -y -qq --no-install-recommends $PACKAGES
	[ -d "$dir/files" ] && cp -a "$dir/files/." "$root/"
	install -m 755 "$dir/entrypoint.sh" "$root/usr/local/bin/docker-entrypoint.sh"
	if [ -f "$dir/setup.sh" ]; then
		install -m 755 "$dir/setup.sh" "$root/tmp/setup.sh"
		"${chr[@]}" /tmp/setup.sh
	fi
	local pkgs
	# shellcheck disable=SC2086
	pkgs=$("${chr[@]}" dpkg-query -W -f '${Package}=${Version} ' $PACKAGES)
	"${chr[@]}" apt-get clean
	umount "$root/proc"
	rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
		"$root"/var/log/apt/* "$root"/var/log/dpkg.log "$root"/var/log/alternatives.log \
		"$root"/tmp/* "$root"/usr/share/man/* "$root"/usr/share/info/*
	find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
	: >"$root/etc/resolv.conf"

	local id
	id=$(tar --numeric-owner -C "$root" -c . | ci_docker import -m "sqllock-ci rootfs $NAME $hash" -)
	rm -rf "$root"
	DOCKER_BUILDKIT=0 ci_docker build -q --build-arg "BASE=$id" --build-arg "VERSION=$VERSION" \
		--label "sqllock.ci.hash=$hash" --label "sqllock.ci.suite=$SUITE" \
		--label "sqllock.ci.packages=${pkgs% }" \
		-t "$NAME" - <"$dir/Dockerfile" >/dev/null
	[ "$(ci_docker image inspect -f '{{index .Config.Labels "sqllock.ci.hash"}}' "$NAME")" = "$hash" ] ||
		ci_die "image $NAME was not built"
	ci_log "image $NAME built in $(($(date +%s) - t0)) s: $SUITE, ${pkgs% }, $(ci_docker image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%d MB", $1/1e6}')"
}

# Build the images in parallel, each logging to its own file.
mkdir -p "$work/log"
pids=() names=()
for i in "${!todo[@]}"; do
	conf=${todo[$i]}
	n=$(basename "$(dirname "$conf")")-$(basename "$conf" .conf)
	names+=("$n")
	ci_log "building $(conf_get "$conf" NAME) from ${conf#"$here"/} ($(conf_get "$conf" SUITE))"
	build_one "$conf" "${hashes[$i]}" >"$work/log/$n.log" 2>&1 &
	pids+=($!)
done
wait_all build "$work/log" "${names[@]}" || ci_die "image build failed"
# Previous versions of the images are now dangling.
ci_docker image prune -f >/dev/null || true
