#!/usr/bin/env bash
# Installs and builds what the producer examples need, for `make test`
# (e2e/producers_test.go runs each example as a process):
#   - python3-psycopg from Debian (psycopg 3 for Debian's /usr/bin/python3),
#     with apt-get when missing
#   - node/node_modules: `npm ci` from package-lock.json (pg)
#   - java/target/produce.jar: `mvn package` (the PostgreSQL JDBC driver from
#     Maven Central, cached in $CACHE_DIR/m2)
# Needs node, npm, java (17+) and mvn on PATH. Run as root with apt-get (a
# fresh Debian machine), it installs the missing ones from Debian (nodejs, npm,
# openjdk-17-jdk-headless, maven); otherwise it says which one is missing.
set -euo pipefail

DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$DIR/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-$REPO/.cache}"
PYTHON=/usr/bin/python3

log() { echo "producers setup: $*" >&2; }
die() { log "$*"; exit 1; }

# can_apt: running as root with apt-get, so missing packages can be installed.
can_apt() { [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "$@" >&2
}

# The Debian package of each tool.
declare -A package=([node]=nodejs [npm]=npm [java]=openjdk-17-jdk-headless [mvn]=maven)
missing=() packages=()
for tool in node npm java mvn; do
  command -v "$tool" >/dev/null || { missing+=("$tool"); packages+=("${package[$tool]}"); }
done
if ((${#missing[@]})); then
  can_apt || die "${missing[0]} not found: install it (Debian: apt-get install nodejs npm openjdk-17-jdk-headless maven)"
  log "${missing[*]} not found; installing Debian's ${packages[*]}"
  apt_install "${packages[@]}" || die "apt-get install ${packages[*]} failed"
  for tool in "${missing[@]}"; do
    command -v "$tool" >/dev/null || die "$tool still not found after apt-get install ${package[$tool]}"
  done
fi
[[ -x $PYTHON ]] || die "$PYTHON not found: apt-get install python3"

if ! "$PYTHON" -c 'import psycopg' 2>/dev/null; then
  log "psycopg not importable by $PYTHON; installing Debian's python3-psycopg"
  apt_install python3-psycopg || die "apt-get install python3-psycopg failed (run it as root)"
fi

log "npm ci in examples/producers/node"
(cd "$DIR/node" && npm ci --no-audit --no-fund --loglevel=error >&2) || die "npm ci failed in $DIR/node"

jar="$DIR/java/target/produce.jar"
# Up to date: the jar newer than the sources, and the driver copied beside
# it (copy-dependencies runs after the jar is written; an interrupted build
# leaves the jar without it).
if [[ -f $jar && -z "$(find "$DIR/java/pom.xml" "$DIR/java/src" -newer "$jar" -print -quit)" ]] &&
  compgen -G "$DIR/java/target/lib/postgresql-*.jar" >/dev/null; then
  log "java/target/produce.jar is up to date"
else
  log "mvn package in examples/producers/java"
  mkdir -p "$CACHE_DIR"
  mvn -q -B -ntp -Dstyle.color=never -Dmaven.repo.local="$CACHE_DIR/m2" -f "$DIR/java/pom.xml" package >&2 ||
    die "mvn package failed in $DIR/java"
fi
