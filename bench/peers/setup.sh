#!/usr/bin/env bash
# Installs the peers `make bench-peers` runs beside outboxrelay, by name from
# their registries (no peer code is committed):
#   - PGSync 7.3.0 from PyPI into a venv under .cache/pgsync-7.3.0
#   - redis-server from Debian (apt-get, when missing)
# and prints their settings as export lines:
#   eval "$(bench/peers/setup.sh)"
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-$REPO/.cache}"
PGSYNC_VERSION="${PGSYNC_VERSION:-7.3.0}"
VENV="$CACHE_DIR/pgsync-$PGSYNC_VERSION"

log() { echo "bench-peers setup: $*" >&2; }

if ! command -v redis-server >/dev/null; then
  log "redis-server not found; installing Debian's redis-server package"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends redis-server >&2
  # The package may start its own server on 6379; the benchmark starts its own.
fi

installed=""
[[ -x "$VENV/bin/pgsync" ]] && installed="$("$VENV/bin/pip" show pgsync 2>/dev/null || true)"
if ! grep -qx "Version: $PGSYNC_VERSION" <<<"$installed"; then
  log "installing pgsync==$PGSYNC_VERSION into $VENV"
  mkdir -p "$CACHE_DIR"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "pgsync==$PGSYNC_VERSION" >&2
fi

echo "export PGSYNC_BIN=$VENV/bin"
echo "export REDIS_SERVER=$(command -v redis-server)"
