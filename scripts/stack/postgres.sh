#!/usr/bin/env bash
# A private PostgreSQL cluster for outboxrelay's tests and demo: Debian's
# postgresql package (installed when missing), initdb into $STACK_DIR/postgres,
# a free loopback port, trust auth on loopback only.
#
#   postgres.sh start    start (or reuse) the cluster; prints DATABASE_URL=...
#   postgres.sh stop     stop it, keep the data
#   postgres.sh purge    stop it and remove the data
#   postgres.sh status   exit 0 and print DATABASE_URL=... when it answers
#   postgres.sh version  print the server version
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STACK_DIR="${STACK_DIR:-$REPO/.stack}"
STATE="$STACK_DIR/postgres"
DATA="$STATE/data"

log() { echo "postgres: $*" >&2; }

find_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [[ -x "$d/initdb" && -x "$d/pg_ctl" ]]; then echo "$d"; return 0; fi
  done
  return 1
}

ensure_installed() {
  if find_bindir >/dev/null; then return 0; fi
  log "PostgreSQL server not found; installing Debian's postgresql package"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
  # The package may start its own cluster on 5432; ours does not use it.
  find_bindir >/dev/null || { log "postgresql installed but initdb not found"; exit 1; }
}

# initdb and postgres refuse to run as root: run them as the postgres user.
as_owner() {
  if [[ $(id -u) -eq 0 ]]; then
    if ! id postgres >/dev/null 2>&1; then
      useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    fi
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# Below the ephemeral range, so a restart finds its port free (see freeport.py).
free_port() {
  python3 "$REPO/scripts/stack/freeport.py" 1
}

url() { echo "DATABASE_URL=postgres://postgres@127.0.0.1:$(cat "$STATE/port")/postgres?sslmode=disable"; }

answering() {
  [[ -f "$STATE/port" ]] || return 1
  local bindir; bindir="$(find_bindir)" || return 1
  "$bindir/pg_isready" -q -h 127.0.0.1 -p "$(cat "$STATE/port")" -t 2
}

running() {
  [[ -f "$DATA/postmaster.pid" ]] || return 1
  local pid; pid="$(head -1 "$DATA/postmaster.pid")"
  kill -0 "$pid" 2>/dev/null
}

cmd_start() {
  ensure_installed
  local bindir; bindir="$(find_bindir)"
  if running && answering; then url | tee "$STATE/env"; return 0; fi
  mkdir -p "$STATE"
  if [[ ! -f "$DATA/PG_VERSION" ]]; then
    local port; port="$(free_port)"
    echo "$port" > "$STATE/port"
    mkdir -p "$DATA"
    [[ $(id -u) -eq 0 ]] && chown -R postgres "$STATE" && chmod 755 "$STACK_DIR" "$STATE"
    log "initdb $DATA"
    as_owner "$bindir/initdb" -D "$DATA" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 --no-sync >"$STATE/initdb.log" 2>&1 \
      || { cat "$STATE/initdb.log" >&2; exit 1; }
    # A test cluster: durability across an OS crash is not under test
    # (the crash tests kill clients, not the server), throughput is.
    cat >> "$DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$STATE'
max_connections = 400
shared_buffers = 512MB
fsync = off
synchronous_commit = off
full_page_writes = off
max_wal_size = 4GB
checkpoint_timeout = 30min
log_min_messages = warning
# Per-statement time and WAL: bench-e2e splits PostgreSQL's share by client.
shared_preload_libraries = 'pg_stat_statements'
CONF
  fi
  [[ $(id -u) -eq 0 ]] && chown -R postgres "$STATE"
  # A stale pid file from a killed server must not block the start.
  if [[ -f "$DATA/postmaster.pid" ]] && ! running; then rm -f "$DATA/postmaster.pid"; fi
  as_owner "$bindir/pg_ctl" -D "$DATA" -l "$STATE/server.log" -w -t 60 start >/dev/null \
    || { tail -20 "$STATE/server.log" >&2; exit 1; }
  url | tee "$STATE/env"
}

cmd_stop() {
  [[ -d "$DATA" ]] || return 0
  local bindir; bindir="$(find_bindir)" || return 0
  if running; then
    as_owner "$bindir/pg_ctl" -D "$DATA" -m fast -w -t 30 stop >/dev/null 2>&1 \
      || as_owner "$bindir/pg_ctl" -D "$DATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  if running; then kill -9 "$(head -1 "$DATA/postmaster.pid")" 2>/dev/null || true; fi
  log "stopped"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  purge) cmd_stop; rm -rf "$STATE" ;;
  status) if running && answering; then url; else exit 1; fi ;;
  version) ensure_installed; "$(find_bindir)/postgres" --version ;;
  *) echo "usage: $0 start|stop|purge|status|version" >&2; exit 2 ;;
esac
