#!/usr/bin/env bash
# The Debezium peer of the publisher (see README.md beside this script).
#
#   debezium.sh build           fetch Debezium 3.6.1.Final and its dependencies from Maven
#                               Central and build the harness into $CACHE_DIR/debezium-peer/;
#                               a no-op (no mvn, no network) while pom.xml and src/ are unchanged
#   debezium.sh classpath       build if needed, print the classpath
#   debezium.sh setup [flags]   build if needed; create the publication and slot, exit
#   debezium.sh run [flags]     build if needed; stream outbox rows to Kafka until SIGTERM
#   debezium.sh help            the harness's flags
#
# Environment: CACHE_DIR (default <repo>/.cache), JAVA (default java),
# JAVA_OPTS (default -Xmx1g), DATABASE_URL and KAFKA_BROKERS (flag defaults).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-$REPO/.cache}"
OUT="$CACHE_DIR/debezium-peer"
LIB="$OUT/lib"
JAVA="${JAVA:-java}"
JAVA_OPTS="${JAVA_OPTS:--Xmx1g}"

die() { echo "debezium.sh: $*" >&2; exit 1; }

# What the build depends on: a new pom or source means a new build.
stamp() { cat "$HERE/pom.xml" $(find "$HERE/src" -type f | sort) | sha256sum | cut -d' ' -f1; }

build() {
  local want; want="$(stamp)"
  if [[ -f "$OUT/stamp" && "$(cat "$OUT/stamp")" == "$want" && -f "$LIB/debezium-peer-1.jar" ]]; then
    return 0
  fi
  command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
  mkdir -p "$OUT"
  # One build at a time: two at once would write the same lib/.
  exec 9>"$OUT.lock"
  flock 9
  if [[ -f "$OUT/stamp" && "$(cat "$OUT/stamp")" == "$want" && -f "$LIB/debezium-peer-1.jar" ]]; then
    return 0
  fi
  echo "debezium.sh: building the harness (Debezium 3.6.1.Final from Maven Central) into $OUT" >&2
  rm -rf "$LIB" "$OUT/target"
  if ! mvn -B -ntp -q -Dstyle.color=never -f "$HERE/pom.xml" \
      -Dmaven.repo.local="$CACHE_DIR/m2" \
      -Dpeer.lib="$LIB" -Dpeer.build="$OUT/target" \
      package >"$OUT/mvn.log" 2>&1; then
    tail -n 40 "$OUT/mvn.log" >&2
    die "mvn package failed (log: $OUT/mvn.log)"
  fi
  echo "$want" >"$OUT/stamp"
}

java_run() {
  build
  # exec: SIGTERM reaches the JVM, whose shutdown hook stops the engine.
  # shellcheck disable=SC2086
  exec "$JAVA" $JAVA_OPTS -cp "$LIB/*" io.github.outboxrelay.peers.DebeziumPeer "$@"
}

case "${1:-}" in
  build) build ;;
  classpath) build; echo "$LIB/*" ;;
  setup|run) java_run "$@" ;;
  help|-h|--help) java_run run --help ;;
  *) echo "usage: $0 build|classpath|setup|run|help [flags]" >&2; exit 2 ;;
esac
