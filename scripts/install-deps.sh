#!/usr/bin/env bash
# install-deps.sh — installs what cairn needs on a Debian 12 machine, idempotently.
#
#   * Debian 12 packages: btrfs-progs, debootstrap, iptables, iproute2, runc, xz-utils
#   * CRIU >= 4.1: the host's criu when `criu check` passes; otherwise Debian 13's criu
#     unpacked into a private prefix (/opt/cairn/criu) and run through its own dynamic
#     loader by a wrapper script, because Debian 12's criu 3.17 fails on recent kernels
#     and Debian 13's libc must not replace the system one.
#   * gVisor's runsc (a static binary) from the Debian archive.
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

# trixie_apt runs apt-get against a private list of Debian 13 only, leaving the system's
# package state untouched.
TRIXIE=/var/lib/cairn-apt-trixie
trixie_apt() {
	apt-get -qq -o Dir::Etc::SourceList="$TRIXIE/sources.list" -o Dir::Etc::SourceParts=/dev/null \
		-o Dir::State::Lists="$TRIXIE/lists" -o Dir::Cache="$TRIXIE/cache" \
		-o Dir::State::Status="$TRIXIE/status" -o APT::Architecture=amd64 "$@"
}
trixie_init() {
	mkdir -p "$TRIXIE/lists/partial" "$TRIXIE/cache/archives/partial" "$TRIXIE/debs"
	: >"$TRIXIE/status"
	echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(mirror) trixie main" >"$TRIXIE/sources.list"
	if [ ! -s "$TRIXIE/lists/.updated" ]; then
		step "reading the Debian 13 package index (private apt state in $TRIXIE)"
		trixie_apt update
		date >"$TRIXIE/lists/.updated"
	fi
}

criu_ok() { "$1" check >/dev/null 2>&1; }

if command -v criu >/dev/null 2>&1 && [ "$(command -v criu)" != "$PREFIX/criu" ] && criu_ok criu; then
	step "host criu passes 'criu check': using $(command -v criu)"
elif [ -x "$PREFIX/criu" ] && criu_ok "$PREFIX/criu"; then
	step "CRIU present in $PREFIX"
else
	trixie_init
	step "downloading CRIU 4.x and its libraries from Debian 13"
	pkgs=(criu libcompel1 libc6 libprotobuf-c1 libnl-3-200 libnet1 libnftables1 libgnutls30t64 libbsd0
		libuuid1 libnettle8t64 libhogweed6t64 libp11-kit0 libunistring5 libtasn1-6 libidn2-0 libgmp10
		libmd0 libjansson4 libmnl0 libnftnl11 libxtables12 libffi8 libzstd1 libgcc-s1 libcap2)
	(cd "$TRIXIE/debs" && trixie_apt download "${pkgs[@]}")
	step "unpacking into $PREFIX"
	rm -rf "$PREFIX.tmp" && mkdir -p "$PREFIX.tmp"
	for d in "$TRIXIE"/debs/*.deb; do dpkg -x "$d" "$PREFIX.tmp"; done
	ld=$(ls "$PREFIX.tmp"/usr/lib64/ld-linux-x86-64.so.2 2>/dev/null || ls "$PREFIX.tmp"/lib64/ld-linux-x86-64.so.2)
	ld=${ld#"$PREFIX.tmp"}
	cat >"$PREFIX.tmp/criu" <<WRAP
#!/bin/sh
# cairn: Debian 13's criu run through its own loader and libraries (see scripts/install-deps.sh).
exec $PREFIX$ld --library-path $PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu $PREFIX/usr/sbin/criu "\$@"
WRAP
	chmod 755 "$PREFIX.tmp/criu"
	rm -rf "$PREFIX" && mv "$PREFIX.tmp" "$PREFIX"
	criu_ok "$PREFIX/criu" || { "$PREFIX/criu" check >&2; echo "criu check failed" >&2; exit 1; }
	step "CRIU $("$PREFIX/criu" --version | head -n1) works"
fi

if command -v runsc >/dev/null 2>&1; then
	step "runsc present"
else
	trixie_init
	step "installing gVisor runsc (static binary) from Debian 13"
	(cd "$TRIXIE/debs" && trixie_apt download runsc)
	tmp=$(mktemp -d)
	dpkg -x "$TRIXIE"/debs/runsc_*.deb "$tmp"
	install -m 755 "$tmp/usr/bin/runsc" /usr/local/bin/runsc
	rm -rf "$tmp"
fi
step "dependencies ready"
