#!/usr/bin/env bash
# install.sh — installs cairn's dependencies (scripts/install-deps.sh) and builds and
# installs the cairn, cairnd and cairn-init binaries into $PREFIX/bin (default
# /usr/local).
# Idempotent; run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${PREFIX:-/usr/local}
export PATH="$PATH:/usr/local/go/bin"
bash scripts/install-deps.sh
printf '\033[1m==> %s\033[0m\n' "building cairn, cairnd and cairn-init into $PREFIX/bin" >&2
mkdir -p "$PREFIX/bin"
CGO_ENABLED=0 go build -trimpath -o "$PREFIX/bin/cairn" ./cmd/cairn
CGO_ENABLED=0 go build -trimpath -o "$PREFIX/bin/cairn-init" ./cmd/cairn-init
CGO_ENABLED=0 go build -trimpath -o "$PREFIX/bin/cairnd" ./cmd/cairnd
printf '\033[1m==> %s\033[0m\n' "cairn installed: start the daemon with \`cairnd\` (or use \`cairn create\` directly)" >&2
