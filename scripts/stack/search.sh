#!/usr/bin/env bash
# One search node for the outboxrelay test stack, OpenSearch or Elasticsearch 7.x, from Maven
# Central jars (no Docker, no tarball): the engine's server jar and module plugins, and
# search/Launcher.java.in, compiled for the engine, starts a Node with the modules on the
# classpath. See DESIGN.md, "Test stack". opensearch.sh and elasticsearch.sh run this script
# with their engine's parameters; search-cluster.sh runs two nodes of it as one cluster.
#
# Usage: scripts/stack/opensearch.sh|elasticsearch.sh fetch|start|stop|purge|status|version
#   fetch    download the jars (mvn dependency:copy-dependencies of a pom made from the
#            parameters below) and compile the launcher into $CACHE_DIR/search-<engine>-<version>/;
#            a no-op (no mvn, no network) once done.
#   start    fetch if needed, start the node (or find it already running) and wait until
#            _cluster/health is yellow; prints exactly one line on stdout,
#            <SEARCH_ENV_NAME>=http://127.0.0.1:<port>, also written to $STACK_DIR/<engine>/env.
#            A state dir left by an earlier stopped node is restarted on the same ports, with
#            the same data, node name and settings.
#   stop     SIGTERM, up to 30 s, then SIGKILL; data is kept.
#   purge    stop, then remove $STACK_DIR/<engine>.
#   status   exit 0 and print the env line if the node runs and answers, else exit 1.
#   version  print the engine version in use.
# Everything except the env line goes to stderr.
#
# Engine parameters (opensearch.sh and elasticsearch.sh set them):
#   SEARCH_ENGINE          opensearch or elasticsearch: names the state dir, logs, process mark
#   SEARCH_VERSION         engine version, e.g. 2.19.6
#   SEARCH_PACKAGE         Java package of the server classes (org.opensearch, org.elasticsearch)
#   SEARCH_ARTIFACTS       Maven group:artifact list (space-separated) fetched at SEARCH_VERSION:
#                          the server jar and the module "client" jars
#   SEARCH_EXTRA_ARTIFACTS group:artifact:version list fetched as given (the log4j2 backend)
#   SEARCH_PLUGINS         module plugin classes, each loaded when on the classpath
#   SEARCH_ENV_NAME        name in the env line (ELASTICSEARCH_URL, ELASTICSEARCH7_URL)
# Other environment:
#   CACHE_DIR              jar/class cache, default <repo>/.cache
#   STACK_DIR              runtime state, default <repo>/.stack (node state in $STACK_DIR/<engine>)
#   JAVA_HOME              java/javac from $JAVA_HOME/bin, else from PATH
#   SEARCH_JAVA_OPTS       extra JVM flags, appended (e.g. -Xmx2g)
#   SEARCH_START_TIMEOUT   seconds to wait for yellow health, default 120
# Only read when a node is first created (kept in its state dir for restarts):
#   SEARCH_CLUSTER_NAME    default outboxrelay-test
#   SEARCH_NODE_NAME       default outboxrelay-node-0
#   SEARCH_PORTS           "<http> <transport>" (default: two free ports)
#   SEARCH_SETTINGS        node settings, space-separated key=value (the launcher's -E)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd)
SRC_DIR=$SCRIPT_DIR/search

ENGINE=${SEARCH_ENGINE:?set SEARCH_ENGINE (opensearch.sh and elasticsearch.sh do)}
VERSION=${SEARCH_VERSION:?set SEARCH_VERSION}
PACKAGE=${SEARCH_PACKAGE:?set SEARCH_PACKAGE}
ARTIFACTS=${SEARCH_ARTIFACTS:?set SEARCH_ARTIFACTS}
EXTRA_ARTIFACTS=${SEARCH_EXTRA_ARTIFACTS:-}
PLUGINS=${SEARCH_PLUGINS:-}
ENV_NAME=${SEARCH_ENV_NAME:?set SEARCH_ENV_NAME}
CACHE_DIR=$(realpath -m -- "${CACHE_DIR:-$REPO_DIR/.cache}")
STACK_DIR=$(realpath -m -- "${STACK_DIR:-$REPO_DIR/.stack}")
START_TIMEOUT=${SEARCH_START_TIMEOUT:-120}
STOP_TIMEOUT=30
CLUSTER_NAME=${SEARCH_CLUSTER_NAME:-outboxrelay-test}
NODE_NAME=${SEARCH_NODE_NAME:-outboxrelay-node-0}

DIST_DIR=$CACHE_DIR/search-$ENGINE-$VERSION
LIBS_DIR=$DIST_DIR/libs
CLASSES_DIR=$DIST_DIR/classes
STATE_DIR=$STACK_DIR/$ENGINE
PID_FILE=$STATE_DIR/$ENGINE.pid
PORTS_FILE=$STATE_DIR/ports
ENV_FILE=$STATE_DIR/env
OUT_FILE=$STATE_DIR/launcher.out
# Marks our JVM's command line, so that pid files are never trusted blindly.
MARK="-Doutboxrelay.stack.$ENGINE=$STATE_DIR"

if [[ -n "${JAVA_HOME:-}" ]]; then
  JAVA=$JAVA_HOME/bin/java
  JAVAC=$JAVA_HOME/bin/javac
else
  JAVA=java
  JAVAC=javac
fi

log() { printf '%s.sh: %s\n' "$ENGINE" "$*" >&2; }
die() { log "$*"; exit 1; }

# ---------------------------------------------------------------------------------- fetch

# pom: the Maven project whose runtime dependencies are the node's jars.
pom() {
  local a g n v deps=""
  for a in $ARTIFACTS; do deps+=$(dependency "${a%%:*}" "${a#*:}" "$VERSION"); done
  for a in $EXTRA_ARTIFACTS; do
    IFS=: read -r g n v <<<"$a"
    deps+=$(dependency "$g" "$n" "$v")
  done
  cat <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- Made by scripts/stack/search.sh for $ENGINE $VERSION: dependency:copy-dependencies input only. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>com.github.outboxrelay</groupId>
  <artifactId>outboxrelay-$ENGINE-stack</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>$deps
  </dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId>
    <artifactId>maven-dependency-plugin</artifactId>
    <version>3.8.1</version>
  </plugin></plugins></build>
</project>
EOF
}
dependency() { printf '\n    <dependency><groupId>%s</groupId><artifactId>%s</artifactId><version>%s</version></dependency>' "$1" "$2" "$3"; }
plugin_list() { local p out=""; for p in $PLUGINS; do out+=${out:+,}$p; done; echo "$out"; }
launcher_source() { sed "s/@ENGINE_PACKAGE@/$PACKAGE/g" "$SRC_DIR/Launcher.java.in"; }

libs_hash() { pom | sha256sum | cut -d' ' -f1; }
classes_hash() { { echo "$VERSION"; launcher_source; } | sha256sum | cut -d' ' -f1; }

is_fetched() {
  [[ -f $DIST_DIR/.libs-ok && -f $DIST_DIR/.classes-ok ]] &&
    [[ $(<"$DIST_DIR/.libs-ok") == "$(libs_hash)" && $(<"$DIST_DIR/.classes-ok") == "$(classes_hash)" ]] &&
    [[ -f $CLASSES_DIR/Launcher.class && -d $LIBS_DIR ]]
}

do_fetch() {
  is_fetched && return 0
  mkdir -p "$DIST_DIR"
  # Serialise concurrent fetches of the same version (e.g. parallel test packages).
  exec 8>"$DIST_DIR/.lock"
  flock -w 900 8 || die "timed out waiting for another fetch ($DIST_DIR/.lock)"
  if [[ ! -f $DIST_DIR/.libs-ok || $(<"$DIST_DIR/.libs-ok") != "$(libs_hash)" ]]; then
    command -v mvn >/dev/null || die "mvn not found (needed once to fetch the $ENGINE jars)"
    log "fetching $ENGINE $VERSION jars from Maven Central into $LIBS_DIR"
    rm -rf "$DIST_DIR/build" "$LIBS_DIR.tmp"
    mkdir -p "$DIST_DIR/build"
    pom >"$DIST_DIR/build/pom.xml" # Maven's litter stays in the cache dir
    if ! (cd "$DIST_DIR/build" &&
      mvn -q -B -Dstyle.color=never -Dmaven.repo.local="$CACHE_DIR/m2" \
        dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$LIBS_DIR.tmp") \
      >"$DIST_DIR/mvn.log" 2>&1; then
      tail -n 40 "$DIST_DIR/mvn.log" >&2
      die "mvn dependency:copy-dependencies failed (log: $DIST_DIR/mvn.log)"
    fi
    rm -rf "$LIBS_DIR"
    mv "$LIBS_DIR.tmp" "$LIBS_DIR"
    rm -rf "$DIST_DIR/build"
    rm -f "$DIST_DIR/.classes-ok"
    libs_hash >"$DIST_DIR/.libs-ok"
  fi
  if [[ ! -f $DIST_DIR/.classes-ok || $(<"$DIST_DIR/.classes-ok") != "$(classes_hash)" ||
    ! -f $CLASSES_DIR/Launcher.class ]]; then
    log "compiling Launcher.java into $CLASSES_DIR"
    rm -rf "$CLASSES_DIR"
    mkdir -p "$CLASSES_DIR"
    mkdir -p "$DIST_DIR/src"
    launcher_source >"$DIST_DIR/src/Launcher.java"
    "$JAVAC" --release 17 -nowarn -d "$CLASSES_DIR" -cp "$LIBS_DIR/*" "$DIST_DIR/src/Launcher.java" >&2 ||
      die "javac Launcher.java failed"
    classes_hash >"$DIST_DIR/.classes-ok"
  fi
  exec 8>&-
}

# ------------------------------------------------------------------------------- process

# pid_is_ours PID: the process exists and is our JVM for this state dir.
pid_is_ours() {
  local pid=$1 cmdline
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  cmdline=$({ tr '\0' '\n' <"/proc/$pid/cmdline"; } 2>/dev/null) || return 1
  grep -qxF -- "$MARK" <<<"$cmdline"
}

# our_pids: every live JVM started for this state dir (normally zero or one).
our_pids() {
  # pattern from a file, so that no grep's own argv (ours or a concurrent one's) matches
  grep -lzxF -f <(printf '%s\n' "$MARK") /proc/[0-9]*/cmdline 2>/dev/null | sed -n 's|^/proc/\([0-9]*\)/cmdline$|\1|p' || true
}

read_pid() { if [[ -f $PID_FILE ]]; then cat "$PID_FILE" 2>/dev/null || true; fi; }

running_pid() {
  local pid
  pid=$(read_pid)
  if [[ -n $pid ]] && pid_is_ours "$pid"; then
    echo "$pid"
    return 0
  fi
  pid=$(our_pids | head -n1)
  [[ -n $pid ]] && echo "$pid"
}

http_port() { if [[ -f $PORTS_FILE ]]; then awk '{print $1}' "$PORTS_FILE"; fi; }

healthy() { # healthy PORT [wait_timeout]
  local body
  body=$(curl -sf --max-time 10 \
    "http://127.0.0.1:$1/_cluster/health?wait_for_status=yellow&timeout=${2:-1s}" 2>/dev/null) || return 1
  [[ $body == *"\"cluster_name\":\"$(cluster_name)\""* ]]
}

cluster_name() { if [[ -f $STATE_DIR/cluster_name ]]; then cat "$STATE_DIR/cluster_name"; else echo "$CLUSTER_NAME"; fi; }
node_name() { if [[ -f $STATE_DIR/node_name ]]; then cat "$STATE_DIR/node_name"; else echo "$NODE_NAME"; fi; }

env_line() { echo "$ENV_NAME=http://127.0.0.1:$1"; }

log_tail() {
  local log
  log=$STATE_DIR/logs/$(cluster_name).log
  if [[ -s $log ]]; then
    echo "----- tail of $log -----" >&2
    # without Java stack frames, so that the cause fits in the tail
    grep -vE '(^|\] )[[:space:]]+(at |\.\.\. [0-9]+ more)' "$log" | tail -n 40 >&2 || true
  fi
  if [[ -s $OUT_FILE ]]; then # JVM output and the launcher's one-line failure summary
    echo "----- tail of $OUT_FILE -----" >&2
    tail -n 10 "$OUT_FILE" >&2
  fi
}

# terminate PID...: SIGTERM, wait up to STOP_TIMEOUT, then SIGKILL; returns 1 if any survive.
terminate() {
  local pid deadline left
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$((SECONDS + STOP_TIMEOUT))
  while :; do
    left=()
    for pid in "$@"; do pid_is_ours "$pid" && left+=("$pid"); done
    ((${#left[@]} == 0)) && return 0
    ((SECONDS >= deadline)) && break
    sleep 0.2
  done
  log "still running after ${STOP_TIMEOUT}s, sending SIGKILL to ${left[*]}"
  for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  deadline=$((SECONDS + 10))
  while ((SECONDS < deadline)); do
    left=()
    for pid in "$@"; do pid_is_ours "$pid" && left+=("$pid"); done
    ((${#left[@]} == 0)) && return 0
    sleep 0.2
  done
  return 1
}

lock_state() {
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock -w $((START_TIMEOUT + STOP_TIMEOUT + 30)) 9 || die "timed out waiting for $STATE_DIR/.lock"
}

pick_ports() {
  # Below the ephemeral range, so a restart finds its port free (see freeport.py).
  python3 "$SCRIPT_DIR/freeport.py" 2 | paste -sd ' ' -
}

# -------------------------------------------------------------------------------- start

do_start() {
  do_fetch
  lock_state

  local pid port tport deadline
  pid=$(running_pid || true)
  if [[ -n $pid ]]; then
    port=$(http_port)
    [[ -n $port ]] || die "node running (pid $pid) but $PORTS_FILE is missing; run stop"
    if healthy "$port" "$((START_TIMEOUT > 30 ? 30 : START_TIMEOUT))s"; then
      log "already running (pid $pid)"
      env_line "$port" | tee "$ENV_FILE"
      return 0
    fi
    log_tail
    die "node running (pid $pid) but not answering on port $port; run stop (or purge)"
  fi
  rm -f "$PID_FILE"

  local first=0
  if [[ -f $PORTS_FILE ]]; then
    read -r port tport <"$PORTS_FILE"
    log "restarting node from $STATE_DIR on ports $port/$tport"
  else
    first=1
    if [[ -n ${SEARCH_PORTS:-} ]]; then
      read -r port tport <<<"$SEARCH_PORTS"
    else
      read -r port tport < <(pick_ports)
    fi
    [[ -n $port && -n $tport ]] || die "could not pick free ports"
    echo "$CLUSTER_NAME" >"$STATE_DIR/cluster_name"
    echo "$NODE_NAME" >"$STATE_DIR/node_name"
    # shellcheck disable=SC2086 # one setting per word
    printf '%s\n' ${SEARCH_SETTINGS:-} >"$STATE_DIR/settings"
    log "starting new node in $STATE_DIR on ports $port/$tport"
  fi

  mkdir -p "$STATE_DIR/tmp" "$STATE_DIR/logs"
  local -a jvm=(
    -Xms512m -Xmx1g -Xss1m
    -XX:+UseG1GC
    -XX:-OmitStackTraceInFastThrow
    -XX:ErrorFile="$STATE_DIR/logs/hs_err_pid%p.log"
    -Djava.io.tmpdir="$STATE_DIR/tmp"
    -Djava.awt.headless=true
    -Dfile.encoding=UTF-8
    -Dlog4j.shutdownHookEnabled=false # our shutdown hook closes the node, then log4j
    -Dlog4j2.disable.jmx=true
    -Dlog4j2.formatMsgNoLookups=true
    -Dio.netty.noUnsafe=true
    -Dio.netty.noKeySetOptimization=true
    -Dio.netty.recycler.maxCapacityPerThread=0
    "$MARK"
  )
  # shellcheck disable=SC2206 # word splitting of user-supplied flags is intended
  [[ -n ${SEARCH_JAVA_OPTS:-} ]] && jvm+=(${SEARCH_JAVA_OPTS})
  local -a node_args=()
  local setting
  if [[ -f $STATE_DIR/settings ]]; then
    while read -r setting; do [[ -n $setting ]] && node_args+=(-E "$setting"); done <"$STATE_DIR/settings"
  fi

  echo "===== $(date -u +%FT%TZ) start on 127.0.0.1:$port (transport $tport) with $JAVA" >>"$OUT_FILE"
  # Detached: own session, no stdin, stdout/stderr to a file (so a caller reading our stdout
  # through a pipe does not wait for the JVM), and without the lock fd.
  setsid "$JAVA" "${jvm[@]}" -cp "$CLASSES_DIR:$LIBS_DIR/*" Launcher \
    --home "$STATE_DIR" --http-port "$port" --transport-port "$tport" \
    --cluster-name "$(cluster_name)" --node-name "$(node_name)" \
    --plugins "$(plugin_list)" "${node_args[@]}" \
    </dev/null >>"$OUT_FILE" 2>&1 9>&- &
  pid=$!
  echo "$pid" >"$PID_FILE"

  deadline=$((SECONDS + START_TIMEOUT))
  while :; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null || true
      log_tail
      rm -f "$PID_FILE"
      die "node exited during startup"
    fi
    if healthy "$port" 1s; then break; fi
    if ((SECONDS >= deadline)); then
      log_tail
      log "node not healthy after ${START_TIMEOUT}s, stopping it"
      terminate "$pid" || log "pid $pid did not die"
      rm -f "$PID_FILE"
      exit 1
    fi
    sleep 0.5
  done

  ((first)) && echo "$port $tport" >"$PORTS_FILE"
  log "started (pid $pid, $((SECONDS))s)"
  env_line "$port" | tee "$ENV_FILE"
}

# --------------------------------------------------------------------------- stop/status

do_stop() {
  [[ -d $STATE_DIR ]] || { log "not running (no $STATE_DIR)"; return 0; }
  lock_state
  local -a pids
  mapfile -t pids < <({ running_pid || true; our_pids; } | sort -u | sed '/^$/d')
  if ((${#pids[@]} == 0)); then
    log "not running"
  else
    log "stopping pid ${pids[*]}"
    terminate "${pids[@]}" || die "could not stop pid ${pids[*]}"
    log "stopped"
  fi
  rm -f "$PID_FILE"
  [[ -z $(our_pids) ]] || die "a node process for $STATE_DIR is still running"
}

do_purge() {
  do_stop
  rm -rf "$STATE_DIR"
  log "removed $STATE_DIR"
}

do_status() {
  local pid port
  pid=$(running_pid || true)
  [[ -n $pid ]] || { log "not running"; return 1; }
  port=$(http_port)
  if [[ -n $port ]] && healthy "$port" 1s; then
    env_line "$port"
    return 0
  fi
  log "pid $pid is running but not answering"
  return 1
}

case "${1:-}" in
  fetch) do_fetch; log "$ENGINE $VERSION ready in $DIST_DIR" ;;
  start) do_start ;;
  stop) do_stop ;;
  purge) do_purge ;;
  status) do_status ;;
  version) echo "$VERSION" ;;
  *)
    echo "usage: $0 fetch|start|stop|purge|status|version" >&2
    exit 2
    ;;
esac
