#!/usr/bin/env bash
# A private Prometheus for outboxrelay's e2e tests and for watching a local
# run: Debian's prometheus package (installed when missing; only its
# binaries are used, no system service), a loopback port, data and config in
# one directory, and the alert rules of deploy/prometheus/alerts.yml.
#
# Targets come from file_sd: DIR/targets/{batcher,publisher,indexer}.json,
# e.g. [{"targets": ["127.0.0.1:9101"]}]. Whoever runs the binaries writes
# them (the e2e test does; Prometheus picks up changes by itself). The scrape
# jobs are named batcher, publisher and indexer, as the rules expect.
#
#   prometheus.sh run DIR   run in the foreground (exec) with DIR's config;
#                           PROMETHEUS_PORT picks the port (default: a free one);
#                           prints PROMETHEUS_URL=... on stderr before exec
#   prometheus.sh start     start in the background in $STACK_DIR/prometheus
#                           (idempotent); prints PROMETHEUS_URL=... when ready
#   prometheus.sh stop      stop that one, keep its data
#   prometheus.sh purge     stop it and remove its directory
#   prometheus.sh status    exit 0 and print PROMETHEUS_URL=... when it answers
#   prometheus.sh version
#
# PROMETHEUS_SCRAPE_INTERVAL (default 1s) sets scrape and rule evaluation.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
STACK_DIR="${STACK_DIR:-$REPO/.stack}"
STATE="$STACK_DIR/prometheus"
INTERVAL="${PROMETHEUS_SCRAPE_INTERVAL:-1s}"

log() { echo "prometheus: $*" >&2; }

ensure_installed() {
  command -v prometheus >/dev/null && return 0
  log "prometheus not found; installing Debian's prometheus package (binaries only)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  # Deny service starts during the install (the package would start a
  # system Prometheus on :9090), unless a policy is in place already.
  local own_policy=false
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=true
  fi
  apt-get install -y -qq --no-install-recommends prometheus >&2 || { $own_policy && rm -f /usr/sbin/policy-rc.d; exit 1; }
  if $own_policy; then rm -f /usr/sbin/policy-rc.d; fi
  # The package enables a system service on machines with systemd; ours
  # runs privately.
  if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  command -v prometheus >/dev/null || { log "installed, but no prometheus binary on PATH"; exit 1; }
}

# write_config DIR: prometheus.yml with file_sd per job, unless present.
write_config() {
  local dir=$1
  mkdir -p "$dir/targets" "$dir/data"
  cp "$REPO/deploy/prometheus/alerts.yml" "$dir/alerts.yml"
  [[ -f "$dir/prometheus.yml" ]] && return 0
  {
    echo "global: {scrape_interval: $INTERVAL, scrape_timeout: $INTERVAL, evaluation_interval: $INTERVAL}"
    echo "rule_files: [alerts.yml]"
    echo "scrape_configs:"
    for job in batcher publisher indexer; do
      [[ -f "$dir/targets/$job.json" ]] || echo '[]' > "$dir/targets/$job.json"
      echo "  - job_name: $job"
      echo "    file_sd_configs: [{files: [targets/$job.json], refresh_interval: 1s}]"
    done
  } > "$dir/prometheus.yml"
}

port_of() { echo "${PROMETHEUS_PORT:-$(python3 "$HERE/freeport.py" 1)}"; }

args() {
  local dir=$1 port=$2
  echo --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
    --storage.tsdb.retention.time=1d --web.listen-address=127.0.0.1:"$port" \
    --web.enable-lifecycle --log.level=warn
}

answering() {
  [[ -f "$STATE/port" ]] || return 1
  curl -fsS -m 2 "http://127.0.0.1:$(cat "$STATE/port")/-/ready" >/dev/null 2>&1
}

running() { [[ -f "$STATE/pid" ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; }

url() { echo "PROMETHEUS_URL=http://127.0.0.1:$(cat "$STATE/port")"; }

cmd_run() {
  local dir=${1:?usage: prometheus.sh run DIR}
  ensure_installed
  write_config "$dir"
  local port; port="$(port_of)"
  log "PROMETHEUS_URL=http://127.0.0.1:$port"
  # shellcheck disable=SC2046 # args are paths without spaces by construction
  cd "$dir" && exec prometheus $(args "$dir" "$port")
}

cmd_start() {
  ensure_installed
  if running && answering; then url; return 0; fi
  write_config "$STATE"
  local port; port="$(port_of)"
  echo "$port" > "$STATE/port"
  # shellcheck disable=SC2046
  (cd "$STATE" && exec prometheus $(args "$STATE" "$port")) >"$STATE/server.log" 2>&1 &
  echo $! > "$STATE/pid"
  for _ in $(seq 1 120); do
    if answering; then url; return 0; fi
    running || { tail -20 "$STATE/server.log" >&2; exit 1; }
    sleep 0.5
  done
  log "not ready after 60 s"; tail -20 "$STATE/server.log" >&2; exit 1
}

cmd_stop() {
  if running; then
    local pid; pid="$(cat "$STATE/pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$STATE/pid"
}

case "${1:-}" in
  run) shift; cmd_run "$@" ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  purge) cmd_stop; rm -rf "$STATE" ;;
  status) if running && answering; then url; else exit 1; fi ;;
  version) ensure_installed; prometheus --version 2>&1 | head -1 ;;
  *) echo "usage: $0 run DIR|start|stop|purge|status|version" >&2; exit 2 ;;
esac
