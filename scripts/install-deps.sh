#!/usr/bin/env bash
# install-deps.sh — installs what cairn needs on a Debian 12 machine, idempotently.
#
#   * Debian 12 packages: btrfs-progs, debootstrap, iptables, iproute2, runc, xz-utils
#   * CRIU >= 4.2: the host's criu when `criu check` passes; otherwise Debian testing's
#     criu unpacked into a private prefix (/opt/cairn/criu) and run through its own
#     dynamic loader by a wrapper script, because Debian 12's criu 3.17 fails on recent
#     kernels and a newer libc must not replace the system one.
#   * gVisor's runsc (a static binary) from the Debian archive.
#   * Host tuning: free page reporting to the hypervisor is switched off (see below).
#
# The Debian mirror is taken from the machine's own apt sources; nothing else is fetched.
set -euo pipefail

PREFIX=${CAIRN_CRIU_PREFIX:-/opt/cairn/criu}
step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "install-deps.sh must run as root" >&2; exit 1; }

need_pkgs=()
for p in btrfs-progs debootstrap iptables iproute2 runc xz-utils ca-certificates procps; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
	step "installing Debian packages: ${need_pkgs[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
else
	step "Debian packages present"
fi

# The mirror URI of the machine's own Debian sources.
mirror() {
	local uri
	uri=$(grep -rhsE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)
	[ -n "$uri" ] || uri=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | grep -v security | awk '{print $2}' | head -n1 || true)
	[ -n "$uri" ] || { echo "no Debian mirror found in /etc/apt sources" >&2; exit 1; }
	echo "$uri"
}

# Newer Debian suites are read through a private apt state (its own sources list, lists,
# cache and an empty dpkg status), so the system's package state is never touched.
# CRIU comes from Debian testing ("forky"): CRIU 4.2 is the first to dump TCP sockets on
# kernels >= 6.16 (they refuse SO_PASSCRED/SO_PASSSEC on inet sockets, which 4.1 fails on).
# runsc comes from Debian 13 ("trixie").
APTDIR=/var/lib/cairn-apt
CRIU_SUITE=${CAIRN_CRIU_SUITE:-forky}
private_apt() {
	apt-get -qq -o Dir::Etc::SourceList="$APTDIR/sources.list" -o Dir::Etc::SourceParts=/dev/null \
		-o Dir::State::Lists="$APTDIR/lists" -o Dir::Cache="$APTDIR/cache" \
		-o Dir::State::Status="$APTDIR/status" -o APT::Architecture=amd64 "$@"
}
private_apt_init() {
	mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial" "$APTDIR/debs"
	: >"$APTDIR/status"
	local m
	m=$(mirror)
	{
		echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $m $CRIU_SUITE main"
		echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $m trixie main"
	} >"$APTDIR/sources.list.new"
	if ! cmp -s "$APTDIR/sources.list.new" "$APTDIR/sources.list" || [ ! -e "$APTDIR/lists/.updated" ]; then
		mv "$APTDIR/sources.list.new" "$APTDIR/sources.list"
		step "reading the Debian $CRIU_SUITE/trixie package indexes (private apt state in $APTDIR)"
		private_apt update
		date >"$APTDIR/lists/.updated"
	fi
	rm -f "$APTDIR/sources.list.new"
}

# criu_ok: `criu check` passes and the version is at least 4.2.
criu_ok() {
	"$1" check >/dev/null 2>&1 || return 1
	local v
	v=$("$1" --version 2>/dev/null | awk '/^Version:/ {print $2}')
	[ "$(printf '%s\n4.2\n' "$v" | sort -V | head -n1)" = "4.2" ]
}

if command -v criu >/dev/null 2>&1 && [ "$(command -v criu)" != "$PREFIX/criu" ] && criu_ok criu; then
	step "host criu passes 'criu check': using $(command -v criu)"
elif [ -x "$PREFIX/criu" ] && criu_ok "$PREFIX/criu"; then
	step "CRIU $("$PREFIX/criu" --version | awk '/^Version:/ {print $2}') present in $PREFIX"
else
	private_apt_init
	step "downloading CRIU and its libraries from Debian $CRIU_SUITE"
	rm -f "$APTDIR"/debs/*.deb
	deps=$(apt-cache -o Dir::Etc::SourceList="$APTDIR/sources.list" -o Dir::Etc::SourceParts=/dev/null \
		-o Dir::State::Lists="$APTDIR/lists" -o Dir::Cache="$APTDIR/cache" -o Dir::State::Status="$APTDIR/status" \
		depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances \
		"criu/$CRIU_SUITE" 2>/dev/null | grep -E '^[a-z0-9]' | sort -u)
	(cd "$APTDIR/debs" && private_apt download $deps 2>&1 | grep -v 'unsandboxed' || true)
	step "unpacking into $PREFIX"
	rm -rf "$PREFIX.tmp" && mkdir -p "$PREFIX.tmp"
	for d in "$APTDIR"/debs/*.deb; do dpkg -x "$d" "$PREFIX.tmp"; done
	ld=$(ls "$PREFIX.tmp"/usr/lib64/ld-linux-x86-64.so.2 2>/dev/null || ls "$PREFIX.tmp"/lib64/ld-linux-x86-64.so.2)
	ld=${ld#"$PREFIX.tmp"}
	cat >"$PREFIX.tmp/criu" <<WRAP
#!/bin/sh
# cairn: Debian's newer criu run through its own loader and libraries (scripts/install-deps.sh).
exec $PREFIX$ld --library-path $PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu $PREFIX/usr/sbin/criu "\$@"
WRAP
	chmod 755 "$PREFIX.tmp/criu"
	rm -rf "$PREFIX" && mv "$PREFIX.tmp" "$PREFIX"
	criu_ok "$PREFIX/criu" || { "$PREFIX/criu" check >&2; echo "criu check failed" >&2; exit 1; }
	step "CRIU $("$PREFIX/criu" --version | awk '/^Version:/ {print $2}') works"
fi

if command -v runsc >/dev/null 2>&1; then
	step "runsc present"
else
	private_apt_init
	step "installing gVisor runsc (static binary) from Debian 13"
	(cd "$APTDIR/debs" && rm -f runsc_*.deb && private_apt download runsc/trixie 2>&1 | grep -v 'unsandboxed' || true)
	tmp=$(mktemp -d)
	dpkg -x "$APTDIR"/debs/runsc_*.deb "$tmp"
	install -m 755 "$tmp/usr/bin/runsc" /usr/local/bin/runsc
	rm -rf "$tmp"
fi
# Free page reporting (virtio-balloon): the guest hands every free 2 MiB block back to
# the hypervisor, which drops it, so the next write to that memory faults in the host
# (~10 µs per page). A checkpoint writes tens of MB of fresh page cache and a restore
# fills fresh anonymous memory: with reporting on, a CRIU dump of 80 MB took ~230 ms of
# freeze here instead of ~45 ms. A machine dedicated to sandboxes keeps its memory, so
# reporting is switched off until the next boot (CAIRN_KEEP_PAGE_REPORTING=1 keeps it).
PR=/sys/module/page_reporting/parameters/page_reporting_order
if [ -w "$PR" ] && [ "${CAIRN_KEEP_PAGE_REPORTING:-0}" != 1 ]; then
	if [ "$(cat "$PR")" -le 10 ]; then
		step "switching off free page reporting to the hypervisor until reboot (CAIRN_KEEP_PAGE_REPORTING=1 to keep it)"
		echo 11 >"$PR"
	fi
fi
# Transparent huge pages for every anonymous mapping. On these virtual machines a page
# fault of user space costs ~21 µs (the hypervisor takes part in each), against ~0.7 µs
# per page when the kernel fills memory itself: a CRIU restore reads its pages into
# fresh anonymous memory one fault per 4 KiB, ~190 MB/s (a 120 MB process: ~650 ms). With
# THP "always" an aligned 2 MiB region is one fault: the same restore took ~170 ms. The
# default "madvise" leaves it to programs, and neither CRIU nor the programs in sandboxes
# ask. defrag stays as it is ("madvise": no compaction stall where nobody asked for one).
# Switched until the next boot (CAIRN_KEEP_THP=1 keeps the machine's setting).
THP=/sys/kernel/mm/transparent_hugepage/enabled
if [ -w "$THP" ] && [ "${CAIRN_KEEP_THP:-0}" != 1 ] && ! grep -q '\[always\]' "$THP"; then
	step "turning transparent huge pages to \"always\" until reboot: each page fault costs ~21 µs here, and THP makes 2 MiB one fault (CAIRN_KEEP_THP=1 to keep the setting)"
	echo always >"$THP"
fi
# Cheap moves between cgroups. Moving a task to another cgroup takes the kernel's global
# cgroup_threadgroup_rwsem for writing, which by default waits for an RCU grace period:
# 5-13 ms per move measured here, and a checkpoint or rollback with zygotes moves each
# process once. favordynmods (on the cgroup2 mount of this hybrid layout; the rwsem is
# global, so it serves the v1 hierarchies too) makes a move ~0.1 ms, for a slightly
# dearer fork and exit. Until the next boot (CAIRN_KEEP_CGROUP_OPTS=1 leaves it).
CG2=/sys/fs/cgroup/unified
if [ "${CAIRN_KEEP_CGROUP_OPTS:-0}" != 1 ] && mountpoint -q "$CG2" && ! grep -q " $CG2 cgroup2 [^ ]*favordynmods" /proc/mounts; then
	step "making cgroup moves cheap until reboot: mount -o remount,favordynmods $CG2 (CAIRN_KEEP_CGROUP_OPTS=1 to keep the mount as it is)"
	mount -o remount,favordynmods "$CG2" || echo "warning: could not set favordynmods on $CG2; zygote checkpoints and rollbacks will wait ~10 ms per cgroup move" >&2
fi

step "dependencies ready"
