#!/usr/bin/env bash
# Real Apache Kafka broker for the tests, no Docker: KRaft combined mode
# (broker + controller in one JVM) run from the jars Maven Central serves.
#
# Usage: scripts/stack/kafka.sh <command>
#   fetch          download the broker jars into $CACHE_DIR/kafka-<version>/libs
#                  (no-op, no network, when a marker says they are there)
#   start          fetch if needed, then start (or restart, same ports and data)
#                  the broker of $STACK_DIR; waits until it is ready; prints
#                  exactly one line on stdout: KAFKA_BROKERS=127.0.0.1:<port>
#                  (also written to $STACK_DIR/kafka/env). Already running: just
#                  prints the env.
#   stop [--purge] stop the broker (SIGTERM, then SIGKILL after
#                  $KAFKA_STOP_TIMEOUT s); keeps the data unless --purge
#   purge          stop and remove $STACK_DIR/kafka
#   status         exit 0 and print the env line if running and answering
#   version        print the Kafka version in use
#
# Environment:
#   CACHE_DIR            jar/m2/tool cache        (default <repo>/.cache)
#   STACK_DIR            per-stack state          (default <repo>/.stack)
#   KAFKA_VERSION        override the pom's kafka.version (3.9.x)
#   JAVA_HOME            java is $JAVA_HOME/bin/java if set, else `java` on PATH
#   KAFKA_HEAP_OPTS      default "-Xms1g -Xmx1g"
#   KAFKA_JVM_OPTS       extra JVM flags
#   KAFKA_START_TIMEOUT  readiness wait in seconds (default 90)
#   KAFKA_STOP_TIMEOUT   SIGTERM grace in seconds  (default 30)
#   KAFKA_NODE_ID, KAFKA_BROKER_PORT, KAFKA_CONTROLLER_PORT, KAFKA_CLUSTER_ID,
#   KAFKA_QUORUM_VOTERS, KAFKA_REPLICATION
#                        one node of a multi-broker cluster (kafka-cluster.sh sets
#                        them; read only when the state is first created, then kept
#                        in stack.conf): node id, fixed ports, the shared cluster id
#                        and controller voters, and the replication factor of new
#                        topics (min.insync.replicas = replication - 1).
#   KAFKA_SECURE         1 adds two secured listeners beside the plaintext one
#                        (scripts/stack/kafka-secure.sh sets it): SASL_SSL
#                        (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512; user alice,
#                        password alice-secret, SCRAM credentials created at
#                        format time) and SSL with required client
#                        certificates (mTLS). Certificates are made by openssl
#                        in $STACK_DIR/kafka/tls; $STACK_DIR/kafka/secure.env
#                        lists the addresses and files.
#
# State ($STACK_DIR/kafka): stack.conf (ports, cluster id), server.properties
# (regenerated each start), data/ (log.dirs), kafka.pid, server.log, console.log, env.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/../.." && pwd)
POM=$SCRIPT_DIR/kafka/pom.xml
LOG4J=$SCRIPT_DIR/kafka/log4j.properties

abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
CACHE_DIR=$(abspath "${CACHE_DIR:-$REPO/.cache}")
STACK_DIR=$(abspath "${STACK_DIR:-$REPO/.stack}")

KAFKA_VERSION=${KAFKA_VERSION:-$(sed -n 's:.*<kafka\.version>\(.*\)</kafka\.version>.*:\1:p' "$POM" | head -n1)}
[[ -n $KAFKA_VERSION ]] || { echo "kafka.sh: cannot read kafka.version from $POM" >&2; exit 1; }

KAFKA_HOME=$CACHE_DIR/kafka-$KAFKA_VERSION
LIBS=$KAFKA_HOME/libs
MARKER=$KAFKA_HOME/.fetched
STACKWAIT=$CACHE_DIR/bin/stackwait
STATE=$STACK_DIR/kafka
PIDFILE=$STATE/kafka.pid
START_TIMEOUT=${KAFKA_START_TIMEOUT:-90}
STOP_TIMEOUT=${KAFKA_STOP_TIMEOUT:-30}
SECURE=${KAFKA_SECURE:-0}
TLSDIR=$STATE/tls
SCRAM_USER=alice
SCRAM_PASSWORD=alice-secret

if [[ -n ${JAVA_HOME:-} ]]; then JAVA=$JAVA_HOME/bin/java; else JAVA=java; fi

log() { echo "kafka.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# ---------------------------------------------------------------- fetch

fetch_key() {
	# Libs are valid for this version and this exact pom.
	echo "$KAFKA_VERSION $(sha256sum "$POM" | cut -d' ' -f1)"
}

fetched() {
	[[ -f $MARKER && -f $LIBS/kafka_2.13-$KAFKA_VERSION.jar ]] && [[ $(<"$MARKER") == "$(fetch_key)" ]]
}

cmd_fetch() {
	if fetched; then
		log "kafka $KAFKA_VERSION jars already in $LIBS"
		return 0
	fi
	mkdir -p "$KAFKA_HOME"
	exec 8>"$KAFKA_HOME.lock"
	flock -w 900 8 || die "timed out waiting for another fetch ($KAFKA_HOME.lock)"
	if fetched; then exec 8>&-; return 0; fi
	command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
	local tmp=$KAFKA_HOME/libs.tmp.$$
	rm -rf "$tmp"
	log "fetching kafka_2.13 $KAFKA_VERSION jars from Maven Central into $LIBS"
	if ! mvn -q -B -ntp -Dstyle.color=never -f "$POM" \
		-Dkafka.version="$KAFKA_VERSION" \
		-Dmaven.repo.local="$CACHE_DIR/m2" \
		-DoutputDirectory="$tmp" -DincludeScope=runtime \
		dependency:copy-dependencies 2>&1 | sed 's/\x1b\[[0-9;]*m//g' >&2; then
		rm -rf "$tmp"
		die "mvn dependency:copy-dependencies failed for kafka $KAFKA_VERSION"
	fi
	[[ -f $tmp/kafka_2.13-$KAFKA_VERSION.jar ]] || { rm -rf "$tmp"; die "kafka_2.13-$KAFKA_VERSION.jar missing after fetch"; }
	rm -rf "$LIBS"
	mv "$tmp" "$LIBS"
	fetch_key >"$MARKER"
	exec 8>&-
}

# ---------------------------------------------------------------- helpers

build_stackwait() {
	local src=$REPO/internal/stack/cmd/stackwait
	if [[ -x $STACKWAIT ]] && [[ -z $(find "$src" "$REPO/go.mod" "$REPO/go.sum" -newer "$STACKWAIT" -print -quit 2>/dev/null) ]]; then
		return 0
	fi
	command -v go >/dev/null || die "go not found (needed to build $STACKWAIT)"
	mkdir -p "$CACHE_DIR/bin"
	log "building $STACKWAIT"
	if (cd "$REPO" && go build -o "$STACKWAIT.tmp.$$" ./internal/stack/cmd/stackwait) >&2; then
		mv -f "$STACKWAIT.tmp.$$" "$STACKWAIT"
	else
		rm -f "$STACKWAIT.tmp.$$"
		[[ -x $STACKWAIT ]] || die "cannot build stackwait"
		log "warning: rebuild of stackwait failed; using the existing binary"
	fi
}

# cmdline PID: the process's argv joined by spaces, plus a trailing space
# (empty for zombies and vanished processes). Bash builtins only, no fork.
cmdline() {
	local -a argv=()
	{ mapfile -d '' argv <"/proc/$1/cmdline"; } 2>/dev/null || return 0
	((${#argv[@]})) && printf '%s ' "${argv[@]}"
	return 0
}

# PIDs of live JVMs running this STATE's broker: a /proc scan for kafka.Kafka
# with our server.properties, so a stale or missing pid file does not matter.
broker_pids() {
	local p
	local want=" kafka.Kafka $STATE/server.properties "
	for p in /proc/[0-9]*; do
		p=${p#/proc/}
		[[ $(cmdline "$p") == *"$want"* ]] && echo "$p"
	done
	return 0
}

# alive PID: PID is a live (not zombie) kafka.Kafka JVM.
alive() { [[ -n ${1:-} ]] && [[ $(cmdline "$1") == *" kafka.Kafka "* ]]; }

# exists PID: PID is a process that has not exited (not a zombie): on a loaded
# machine the launched subshell can take seconds to exec into the JVM.
exists() {
	[[ -n ${1:-} && -r /proc/$1/stat ]] || return 1
	local stat
	stat=$(<"/proc/$1/stat") 2>/dev/null || return 1
	stat=${stat##*) }
	[[ ${stat%% *} != Z ]]
}

broker_addr() {
	# shellcheck disable=SC1091
	(source "$STATE/stack.conf" && echo "127.0.0.1:$BROKER_PORT")
}

print_env() {
	local line="KAFKA_BROKERS=$1"
	[[ $SECURE == 1 ]] && write_secure_env
	echo "$line" >"$STATE/env"
	echo "$line"
}

write_server_properties() {
	# shellcheck disable=SC1091
	source "$STATE/stack.conf"
	cat >"$STATE/server.properties" <<EOF
# Generated by scripts/stack/kafka.sh on each start; edit the script, not this file.
process.roles=broker,controller
node.id=${NODE_ID:-1}
controller.quorum.voters=${VOTERS:-1@127.0.0.1:$CONTROLLER_PORT}
listeners=PLAINTEXT://127.0.0.1:$BROKER_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$BROKER_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$STATE/data
num.partitions=3
default.replication.factor=${REPLICATION:-1}
min.insync.replicas=$(( ${REPLICATION:-1} > 1 ? ${REPLICATION:-1} - 1 : 1 ))
offsets.topic.replication.factor=${REPLICATION:-1}
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=${REPLICATION:-1}
transaction.state.log.min.isr=$(( ${REPLICATION:-1} > 1 ? ${REPLICATION:-1} - 1 : 1 ))
transaction.state.log.num.partitions=10
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
delete.topic.enable=true
file.delete.delay.ms=5000
message.max.bytes=1048588
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=168
log.segment.bytes=104857600
EOF
	[[ $SECURE == 1 ]] || return 0
	# The secured listeners are added to, not swapped for, the plaintext one,
	# which stays the inter-broker listener.
	sed -i \
		-e "s|^listeners=.*|listeners=PLAINTEXT://127.0.0.1:$BROKER_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT,SASL_SSL://127.0.0.1:$SASL_SSL_PORT,SSL://127.0.0.1:$SSL_PORT|" \
		-e "s|^advertised.listeners=.*|advertised.listeners=PLAINTEXT://127.0.0.1:$BROKER_PORT,SASL_SSL://127.0.0.1:$SASL_SSL_PORT,SSL://127.0.0.1:$SSL_PORT|" \
		-e "s|^listener.security.protocol.map=.*|listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL|" \
		"$STATE/server.properties"
	cat >>"$STATE/server.properties" <<EOF
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLSDIR/server.p12
ssl.keystore.password=changeit
ssl.key.password=changeit
ssl.truststore.type=PEM
ssl.truststore.location=$TLSDIR/ca.pem
listener.name.ssl.ssl.client.auth=required
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SCRAM_USER="$SCRAM_PASSWORD";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
EOF
}

write_secure_env() {
	# shellcheck disable=SC1091
	source "$STATE/stack.conf"
	cat >"$STATE/secure.env" <<EOF
KAFKA_SASL_SSL_BROKERS=127.0.0.1:$SASL_SSL_PORT
KAFKA_SSL_BROKERS=127.0.0.1:$SSL_PORT
KAFKA_TLS_CA_FILE=$TLSDIR/ca.pem
KAFKA_TLS_CERT_FILE=$TLSDIR/client.pem
KAFKA_TLS_KEY_FILE=$TLSDIR/client.key
KAFKA_OTHER_CA_FILE=$TLSDIR/other-ca.pem
KAFKA_OTHER_CERT_FILE=$TLSDIR/other-client.pem
KAFKA_OTHER_KEY_FILE=$TLSDIR/other-client.key
KAFKA_SASL_USERNAME=$SCRAM_USER
KAFKA_SASL_PASSWORD=$SCRAM_PASSWORD
EOF
}

# sign NAME CA SUBJECT-CN EXTENSIONS: a key and a certificate signed by CA.
sign() {
	local d=$TLSDIR
	openssl req -newkey rsa:2048 -nodes -subj "/CN=$3" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null &&
		openssl x509 -req -in "$d/$1.csr" -CA "$d/$2.pem" -CAkey "$d/$2.key" -CAcreateserial -days 3650 \
			-extfile <(printf '%s\n' "$4") -out "$d/$1.pem" 2>/dev/null || die "openssl: cannot sign $1"
}

# make_certs: a CA, a server certificate for 127.0.0.1/localhost, a client
# certificate (mTLS), and a second, untrusted CA with its own client
# certificate (for the tests' "untrusted" cases). openssl only.
make_certs() {
	command -v openssl >/dev/null || die "openssl not found (apt-get install openssl)"
	mkdir -p "$TLSDIR"
	local d=$TLSDIR ca
	for ca in ca other-ca; do
		openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outboxrelay test $ca" \
			-keyout "$d/$ca.key" -out "$d/$ca.pem" 2>/dev/null || die "openssl: cannot make $ca"
	done
	sign server ca localhost $'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth'
	sign client ca "$SCRAM_USER" "extendedKeyUsage=clientAuth"
	sign other-client other-ca "$SCRAM_USER" "extendedKeyUsage=clientAuth"
	openssl pkcs12 -export -in "$d/server.pem" -inkey "$d/server.key" -certfile "$d/ca.pem" \
		-name server -passout pass:changeit -out "$d/server.p12" || die "openssl: cannot write server.p12"
	chmod 600 "$d"/*.key
}

java_opts() {
	# shellcheck disable=SC2206
	local heap=(${KAFKA_HEAP_OPTS:--Xms1g -Xmx1g})
	# shellcheck disable=SC2206
	local extra=(${KAFKA_JVM_OPTS:-})
	# G1HeapRegionSize: a produce request is read into one heap buffer of
	# up to message.max.bytes (1 MB). With the 1 MB regions G1 picks for a
	# heap this size, each such buffer is a humongous object, and their
	# allocation kept starting collections: pauses of 100-300 ms while the
	# publisher benchmark ran, in which no produce request was answered.
	# In 4 MB regions they are ordinary young objects. A fixed heap size
	# saves G1 resizing it. (Kafka's own recommendation is 16 MB regions on
	# a 6 GB heap.)
	JAVA_OPTS=("${heap[@]}" -server -XX:+UseG1GC -XX:G1HeapRegionSize=4M -XX:MaxGCPauseMillis=20
		-XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent
		-XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
		"-Dlog4j.configuration=file:$LOG4J" "-Dkafka.logs.dir=$STATE"
		${extra[@]+"${extra[@]}"} -cp "$LIBS/*")
}

format_storage() {
	# shellcheck disable=SC1091
	source "$STATE/stack.conf"
	local -a SCRAM_ARGS=()
	if [[ $SECURE == 1 ]]; then
		SCRAM_ARGS=(--add-scram "SCRAM-SHA-256=[name=$SCRAM_USER,password=$SCRAM_PASSWORD]"
			--add-scram "SCRAM-SHA-512=[name=$SCRAM_USER,password=$SCRAM_PASSWORD]")
	fi
	log "formatting $STATE/data (cluster id $CLUSTER_ID)"
	"$JAVA" -Xmx256m "-Dlog4j.configuration=file:$LOG4J" "-Dkafka.logs.dir=$STATE" -cp "$LIBS/*" \
		kafka.tools.StorageTool format --cluster-id="$CLUSTER_ID" -c "$STATE/server.properties" ${SCRAM_ARGS[@]+"${SCRAM_ARGS[@]}"} >&2 \
		|| die "kafka-storage format failed"
}

new_state() {
	rm -rf "$STATE"
	mkdir -p "$STATE/data"
	local ports cid
	# Below the ephemeral range, so a restart finds its port free (see freeport.py).
	ports=$(python3 "$SCRIPT_DIR/freeport.py" 4) || die "cannot pick free ports"
	# A Kafka cluster id is 16 random bytes, base64url without padding (22
	# chars). Like Kafka's own random ids, never one that starts with '-':
	# kafka-storage took such an id for an option (1 start in 64 failed).
	cid=${KAFKA_CLUSTER_ID:--}
	while [[ $cid == -* ]]; do
		cid=$(head -c16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
	done
	{
		echo "BROKER_PORT=${KAFKA_BROKER_PORT:-$(sed -n 1p <<<"$ports")}"
		echo "CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-$(sed -n 2p <<<"$ports")}"
		echo "CLUSTER_ID=$cid"
		echo "SASL_SSL_PORT=$(sed -n 3p <<<"$ports")"
		echo "SSL_PORT=$(sed -n 4p <<<"$ports")"
		if [[ -n ${KAFKA_NODE_ID:-} ]]; then
			echo "NODE_ID=$KAFKA_NODE_ID"
			echo "VOTERS=$KAFKA_QUORUM_VOTERS"
			echo "REPLICATION=${KAFKA_REPLICATION:-1}"
		fi
	} >"$STATE/stack.conf"
	if [[ $SECURE == 1 ]]; then make_certs; fi
}

STARTED_PID=
READY=
kill_started() {
	local pid=$STARTED_PID
	[[ -n $pid && -z $READY ]] || return 0
	STARTED_PID=
	alive "$pid" || return 0
	log "killing broker pid $pid that did not become ready"
	kill -TERM "$pid" 2>/dev/null || true
	local i
	for ((i = 0; i < 50; i++)); do alive "$pid" || break; sleep 0.2; done
	alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
	for ((i = 0; i < 25; i++)); do alive "$pid" || break; sleep 0.2; done
	rm -f "$PIDFILE"
}

LOG_MARK=0
dump_logs() {
	local f=$STATE/server.log
	if [[ -s $f ]]; then
		echo "----- errors in $f (this start) -----" >&2
		tail -n "+$((LOG_MARK + 1))" "$f" | grep -E '^\[.*\] (ERROR|FATAL)|^Caused by' | tail -n 15 >&2 || true
		echo "----- tail of $f -----" >&2
		tail -n 30 "$f" >&2
	fi
	f=$STATE/console.log
	if [[ -s $f ]]; then
		echo "----- tail of $f -----" >&2
		tail -n 30 "$f" >&2
	fi
}

# wait_ready PID ADDR: 0 when ready, 1 when the JVM died or the wait timed out.
wait_ready() {
	local pid=$1 addr=$2 deadline=$((SECONDS + START_TIMEOUT)) rem
	while :; do
		if ! alive "$pid"; then
			exists "$pid" || { log "broker pid $pid exited during startup"; return 1; }
			((SECONDS < deadline)) || { log "broker pid $pid did not exec the JVM within ${START_TIMEOUT}s"; return 1; }
			sleep 0.2 # still exec'ing into the JVM
			continue
		fi
		rem=$((deadline - SECONDS))
		((rem > 0)) || { log "broker not ready after ${START_TIMEOUT}s: $(tail -n1 "$STATE/probe.err" 2>/dev/null)"; return 1; }
		((rem > 10)) && rem=10
		if "$STACKWAIT" kafka "$addr" "${rem}s" 2>"$STATE/probe.err"; then
			return 0
		fi
	done
}

launch() {
	java_opts
	: >"$STATE/console.log"
	LOG_MARK=$(cat "$STATE/server.log" 2>/dev/null | wc -l)
	# Close the lock fds so the JVM does not hold the stack lock; setsid +
	# nohup detach it from the caller's session and terminal.
	(cd "$STATE" && exec setsid nohup "$JAVA" "${JAVA_OPTS[@]}" kafka.Kafka "$STATE/server.properties" \
		</dev/null >>"$STATE/console.log" 2>&1 8>&- 9>&-) &
	local pid=$! i
	STARTED_PID=$pid
	# setsid execs in place (the subshell is no group leader), so $! is the JVM;
	# double-check through /proc in case it forked. Under load the exec chain
	# can take seconds, so wait while the launched process still exists.
	for ((i = 0; i < 300; i++)); do
		alive "$pid" && break
		local found
		found=$(broker_pids | head -n1)
		if [[ -n $found ]]; then pid=$found; STARTED_PID=$pid; break; fi
		exists "$pid" || break
		sleep 0.1
	done
	echo "$pid" >"$PIDFILE"
}

# ---------------------------------------------------------------- commands

lock_stack() {
	mkdir -p "$STACK_DIR"
	exec 9>"$STACK_DIR/.kafka.lock"
	flock -w 300 9 || die "timed out waiting for $STACK_DIR/.kafka.lock"
}

cmd_start() {
	lock_stack
	build_stackwait
	local addr pid
	if [[ -f $STATE/stack.conf ]]; then
		addr=$(broker_addr)
		pid=$(broker_pids | head -n1)
		if [[ -n $pid ]]; then
			if wait_ready "$pid" "$addr"; then
				echo "$pid" >"$PIDFILE"
				print_env "$addr"
				return 0
			fi
			die "broker pid $pid of $STATE is running but not answering on $addr; run '$0 stop' first"
		fi
	fi

	cmd_fetch
	"$JAVA" -version >/dev/null 2>&1 || die "java not runnable: $JAVA"
	trap 'kill_started' EXIT
	trap 'exit 130' INT TERM

	local fresh=0 attempt
	if [[ ! -f $STATE/stack.conf || ! -f $STATE/data/meta.properties ]]; then fresh=1; fi
	for attempt in 1 2 3; do
		if ((fresh)); then
			new_state
			write_server_properties
			format_storage
		else
			log "restarting broker from existing $STATE"
			write_server_properties
		fi
		addr=$(broker_addr)
		launch
		log "started broker pid $STARTED_PID on $addr; waiting up to ${START_TIMEOUT}s"
		if wait_ready "$STARTED_PID" "$addr"; then
			READY=1
			print_env "$addr"
			return 0
		fi
		dump_logs
		kill_started
		# A fresh broker whose randomly picked port got taken: retry with new ports.
		if ((fresh)) && { tail -n "+$((LOG_MARK + 1))" "$STATE/server.log"; cat "$STATE/console.log"; } 2>/dev/null | grep -q 'Address already in use'; then
			log "port clash; retrying with new ports"
			continue
		fi
		break
	done
	die "kafka broker failed to start (state in $STATE)"
}

stop_broker() {
	local pids pid i
	mapfile -t pids < <(broker_pids)
	if ((${#pids[@]} == 0)); then
		log "no broker running for $STATE"
		rm -f "$PIDFILE"
		return 0
	fi
	log "stopping broker pid(s) ${pids[*]}"
	kill -TERM "${pids[@]}" 2>/dev/null || true
	for ((i = 0; i < STOP_TIMEOUT * 5; i++)); do
		mapfile -t pids < <(broker_pids)
		((${#pids[@]})) || break
		sleep 0.2
	done
	if ((${#pids[@]})); then
		log "broker did not exit within ${STOP_TIMEOUT}s; sending SIGKILL to ${pids[*]}"
		kill -KILL "${pids[@]}" 2>/dev/null || true
		for ((i = 0; i < 50; i++)); do
			mapfile -t pids < <(broker_pids)
			((${#pids[@]})) || break
			sleep 0.2
		done
	fi
	((${#pids[@]} == 0)) || die "broker pid(s) ${pids[*]} still alive"
	rm -f "$PIDFILE"
}

cmd_stop() {
	local purge=0
	case ${1:-} in
	"") ;;
	--purge) purge=1 ;;
	*) die "usage: $0 stop [--purge]" ;;
	esac
	lock_stack
	stop_broker
	if ((purge)); then
		rm -rf "$STATE"
		log "removed $STATE"
	fi
}

cmd_status() {
	[[ -f $STATE/stack.conf ]] || { log "no broker state in $STATE"; return 1; }
	local addr pid
	addr=$(broker_addr)
	pid=$(broker_pids | head -n1)
	[[ -n $pid ]] || { log "broker of $STATE is not running"; return 1; }
	[[ -x $STACKWAIT ]] || build_stackwait
	if "$STACKWAIT" kafka "$addr" 5s 2>/dev/null; then
		echo "KAFKA_BROKERS=$addr"
		return 0
	fi
	log "broker pid $pid is running but not answering on $addr"
	return 1
}

case ${1:-} in
fetch) cmd_fetch ;;
start) cmd_start ;;
stop) shift; cmd_stop "$@" ;;
purge) cmd_stop --purge ;;
status) cmd_status ;;
version) echo "$KAFKA_VERSION" ;;
*)
	echo "usage: $0 {fetch|start|stop [--purge]|purge|status|version}" >&2
	exit 2
	;;
esac
