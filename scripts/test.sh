#!/usr/bin/env bash
# test.sh — the whole test suite, as CI runs it (.ci/run calls this). Run as root: the
# tests drive real CRIU, btrfs, namespaces and cgroups. It installs what they need first
# (idempotently). With CI=true a missing prerequisite fails a test instead of skipping it.
#
# The tests share one data directory ($CAIRN_TEST_DATA_DIR, default /var/tmp/cairn-test)
# whose pool caches the default Debian template: the first run builds it (~70 s). The
# Python SDK's tests (sdk/python/tests) start their own cairnd, over $CAIRN_TEST_DATA_DIR
# too (default /var/tmp/cairn-test-py), after the Go suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"
bash scripts/install-deps.sh
step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
step "go vet"
go vet ./...
unformatted=$(gofmt -l . | grep -v '^vendor/' || true)
if [ -n "$unformatted" ]; then
	echo "gofmt needed on: $unformatted" >&2
	exit 1
fi
step "race detector on the packages that need no root"
go test -race -count=1 ./errdefs/ ./store/
step "the whole suite (real CRIU, btrfs, processes)"
go test -count=1 -p 1 -timeout 80m "$@" ./...
step "Python SDK (sdk/python): unit tests, and end to end against a real cairnd"
PYTHONDONTWRITEBYTECODE=1 python3 -m unittest discover -s sdk/python/tests -v
step "all tests passed (go vet, gofmt, go test, Python SDK)"
