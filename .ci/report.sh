#!/usr/bin/env bash
# Usage: .ci/report.sh [--module PATH] PAIR LOG [PAIR LOG ...]
#
# Reads the plain output of `go test ./...` (LOG) of each server pair (PAIR =
# PG+MYSQL, e.g. postgres:17+mariadb:11.8, the servers the run had) and prints
# a table package x server with
#   ok    the package passed against the pair
#   FAIL  it failed, and a failing test names this server's dialect (a path
#         element "postgres" or "mysql", as testdb.ForEach names its subtests),
#         or the failure names neither (a panic, a timeout, a test without
#         dialect subtests, a build failure): then both servers of the pair FAIL
#   pass  it failed, but only on the other server of the pair
#   -     no test files
#   ?     no result line (the run was cut short)
# followed by the failing tests per server, each with its first output line.
# Exits 1 if any package failed or has no result, 0 otherwise.
set -euo pipefail

module=""
if [ "${1:-}" = --module ]; then
	module=$2
	shift 2
fi
[ $# -ge 2 ] && [ $(($# % 2)) = 0 ] || { echo "usage: report.sh [--module PATH] PAIR LOG [PAIR LOG ...]" >&2; exit 2; }

args=()
while [ $# -gt 0 ]; do
	pair=$1 log=$2
	shift 2
	case $pair in ?*+?*) ;; *) echo "report.sh: bad pair '$pair'" >&2; exit 2 ;; esac
	[ -f "$log" ] || { echo "report.sh: no log $log" >&2; exit 2; }
	args+=("pg=${pair%%+*}" "my=${pair#*+}" "$log")
done

awk -v module="$module" '
function short(p) {
	if (module != "" && p == module) return "."
	if (module != "" && index(p, module "/") == 1) return substr(p, length(module) + 2)
	return p
}
function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t\r]+$/, "", s); return s }
function addserver(s) { if (!(s in sidx)) { ns++; sname[ns] = s; sidx[s] = ns } }
function addpkg(p) { if (!(p in pidx)) { np++; pname[np] = p; pidx[p] = np } }
# dialect(name): "postgres", "mysql" or "" from the path elements of a test name.
function dialect(name,   n, parts, i, d) {
	n = split(name, parts, "/")
	d = ""
	for (i = 2; i <= n; i++) {
		if (parts[i] == "postgres" || parts[i] == "mysql") { d = parts[i]; break }
	}
	return d
}
function fail(server, pkg, what) {
	cell[server, pkg] = "FAIL"
	nf[server]++
	if (nf[server] <= 40) flist[server, nf[server]] = short(pkg) ": " what
}
function result(pkg, status,   i, j, leaf, d, any, what) {
	addpkg(pkg)
	if (status == "ok") { cell[pg, pkg] = "ok"; cell[my, pkg] = "ok" }
	else if (status == "none") { cell[pg, pkg] = "-"; cell[my, pkg] = "-" }
	else {
		cell[pg, pkg] = "pass"; cell[my, pkg] = "pass"
		any = 0
		for (i = 1; i <= nt; i++) {
			leaf = 1
			for (j = 1; j <= nt; j++)
				if (j != i && index(tname[j], tname[i] "/") == 1) { leaf = 0; break }
			if (!leaf) continue
			any = 1
			d = dialect(tname[i])
			what = tname[i] (tmsg[i] != "" ? "  " tmsg[i] : "")
			if (d != "mysql") fail(pg, pkg, what)
			if (d != "postgres") fail(my, pkg, what)
		}
		if (!any) {
			what = "package failed" (status == "build" ? " to build" : "") (first != "" ? ": " first : "")
			fail(pg, pkg, what)
			fail(my, pkg, what)
		}
	}
	nt = 0; cur = 0; first = ""
}
FNR == 1 {
	addserver(pg); addserver(my)
	nt = 0; cur = 0; first = ""
}
/^testdb: (postgres|mysql) server: / {
	s = $0; sub(/^testdb: /, "", s)
	d = s; sub(/ .*/, "", d)
	sub(/^[a-z]+ server: /, "", s); sub(/ \[.*\]$/, "", s)
	version[d == "postgres" ? pg : my] = s
	next
}
/^[ \t]*--- FAIL: / {
	s = $0; sub(/^[ \t]*--- FAIL: /, "", s); sub(/ \([0-9.]+s\)$/, "", s)
	nt++; tname[nt] = s; tmsg[nt] = ""; cur = nt
	next
}
/^[ \t]*--- (PASS|SKIP): / { cur = 0; next }
/^ok  \t/ { split($0, f, "\t"); result(f[2], "ok"); next }
/^\?   \t/ { split($0, f, "\t"); result(f[2], "none"); next }
/^FAIL\t/ {
	split($0, f, "\t"); p = f[2]
	st = (p ~ / \[build failed\]$/) ? "build" : "fail"
	sub(/ \[[a-z ]+\]$/, "", p)
	result(p, st)
	next
}
/^(FAIL|PASS|exit status [0-9]+|=== (RUN|PAUSE|CONT|NAME).*)$/ { next }
{
	s = trim($0)
	if (s == "") next
	if (cur > 0 && tmsg[cur] == "") tmsg[cur] = s
	else if (first == "" && s !~ /^testdb: / && s !~ /^# /) first = s
}
END {
	# Rows in package order ("." first), whatever order the runs had.
	for (i = 2; i <= np; i++) {
		p = pname[i]
		for (j = i - 1; j >= 1 && short(pname[j]) > short(p); j--) pname[j + 1] = pname[j]
		pname[j + 1] = p
	}
	w = 7
	for (i = 1; i <= np; i++) if (length(short(pname[i])) > w) w = length(short(pname[i]))
	bad = 0
	line = sprintf("%-" w "s", "package")
	for (k = 1; k <= ns; k++) line = line sprintf("  %-13s", sname[k])
	sub(/ +$/, "", line); print line
	for (i = 1; i <= np; i++) {
		line = sprintf("%-" w "s", short(pname[i]))
		for (k = 1; k <= ns; k++) {
			c = ((sname[k], pname[i]) in cell) ? cell[sname[k], pname[i]] : "?"
			if (c == "FAIL" || c == "?") bad = 1
			line = line sprintf("  %-13s", c)
		}
		sub(/ +$/, "", line); print line
	}
	if (np == 0) { print "(no package results)"; bad = 1 }
	hdr = 0
	for (k = 1; k <= ns; k++) {
		s = sname[k]
		if (!(s in version)) continue
		if (!hdr++) printf "\nservers (as testdb logged them in failing packages):\n"
		printf "  %s: %s\n", s, version[s]
	}
	for (k = 1; k <= ns; k++) {
		s = sname[k]
		if (!(s in nf)) continue
		printf "\nfailures on %s (%d):\n", s, nf[s]
		for (i = 1; i <= nf[s] && i <= 40; i++) printf "  %s\n", flist[s, i]
		if (nf[s] > 40) printf "  ... and %d more\n", nf[s] - 40
	}
	exit bad
}
' "${args[@]}"
