#!/usr/bin/env bash
# The whole local stack: PostgreSQL, Kafka (KRaft), OpenSearch and Elasticsearch 7.17
# (the second engine the conformance suite runs against), no Docker.
#
#   stack.sh up      start what is not running; prints the settings as
#                    export lines (eval "$(scripts/stack/stack.sh up)")
#   stack.sh up postgres kafka opensearch
#                    only those (make demo: the engine it uses, not both)
#   stack.sh down    stop all three; no java or postgres process of ours is left
#   stack.sh purge   down, then remove their data
#   stack.sh env     print the settings of a running stack
#   stack.sh versions
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
export STACK_DIR="${STACK_DIR:-$REPO/.stack}"
export CACHE_DIR="${CACHE_DIR:-$REPO/.cache}"
SERVICES=(postgres kafka opensearch elasticsearch)

time_start() {
  local svc=$1 t0 line
  t0=$(date +%s%N)
  line="$("$HERE/$svc.sh" start)"
  echo "$svc: ready in $(( ($(date +%s%N) - t0) / 1000000 )) ms" >&2
  echo "export $line"
}

case "${1:-}" in
  up)
    shift
    want=("${SERVICES[@]}")
    if (($#)); then
      for svc in "$@"; do
        [[ " ${SERVICES[*]} " == *" $svc "* ]] || { echo "stack.sh up: unknown service $svc (want some of: ${SERVICES[*]})" >&2; exit 2; }
      done
      want=("$@")
    fi
    mkdir -p "$STACK_DIR"
    # Fetch the jars of the JVM servers first so their starts do not race
    # on the shared Maven repository.
    for svc in kafka opensearch elasticsearch; do
      [[ " ${want[*]} " == *" $svc "* ]] && "$HERE/$svc.sh" fetch >&2
    done
    out="$(mktemp)"
    for svc in "${want[@]}"; do time_start "$svc" >>"$out" || { rm -f "$out"; exit 1; }; done
    cat "$out" | tee "$STACK_DIR/env"
    rm -f "$out"
    ;;
  down)
    for svc in elasticsearch opensearch kafka postgres; do "$HERE/$svc.sh" stop || true; done
    ;;
  purge)
    for svc in elasticsearch opensearch kafka postgres; do "$HERE/$svc.sh" purge || true; done
    ;;
  env)
    for svc in "${SERVICES[@]}"; do echo "export $("$HERE/$svc.sh" status)"; done
    ;;
  versions)
    for svc in "${SERVICES[@]}"; do printf '%s: %s\n' "$svc" "$("$HERE/$svc.sh" version)"; done
    ;;
  *) echo "usage: $0 up [service...]|down|purge|env|versions" >&2; exit 2 ;;
esac
