#!/usr/bin/env bash
# A 3-broker Kafka cluster (KRaft, each node broker + controller, a 3-voter
# quorum) for the failover tests: new topics get replication 3 and
# min.insync.replicas 2. Each node is a kafka.sh state in
# $STACK_DIR/kafka-cluster/node-<id>, so one node can be stopped and started
# again on its own (STACK_DIR=$STACK_DIR/kafka-cluster/node-2 kafka.sh stop).
#
# Usage: scripts/stack/kafka-cluster.sh {start|stop|purge|status}
#   start  starts the three nodes at once (a quorum needs two) and prints
#          KAFKA_BROKERS=127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3> last
# Environment: as kafka.sh (KAFKA_HEAP_OPTS defaults to -Xms384m -Xmx384m here).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/../.." && pwd)
abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
STACK_DIR=$(abspath "${STACK_DIR:-$REPO/.stack}")
CLUSTER=$STACK_DIR/kafka-cluster
NODES=(1 2 3)
export KAFKA_HEAP_OPTS=${KAFKA_HEAP_OPTS:--Xms384m -Xmx384m}

log() { echo "kafka-cluster.sh: $*" >&2; }
die() { log "$*"; exit 1; }

node() { # ID VERB
	STACK_DIR=$CLUSTER/node-$1 bash "$SCRIPT_DIR/kafka.sh" "$2"
}

cmd_start() {
	mkdir -p "$CLUSTER"
	bash "$SCRIPT_DIR/kafka.sh" fetch
	if [[ ! -f $CLUSTER/cluster.conf ]]; then
		local ports cid voters="" i
		ports=$(python3 "$SCRIPT_DIR/freeport.py" 6) || die "cannot pick free ports"
		cid=-
		while [[ $cid == -* ]]; do cid=$(head -c16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n'); done
		for i in "${NODES[@]}"; do
			voters+="${voters:+,}$i@127.0.0.1:$(sed -n "$((2 * i))p" <<<"$ports")"
		done
		{
			echo "CLUSTER_ID=$cid"
			echo "VOTERS=$voters"
			for i in "${NODES[@]}"; do
				echo "BROKER_PORT_$i=$(sed -n "$((2 * i - 1))p" <<<"$ports")"
				echo "CONTROLLER_PORT_$i=$(sed -n "$((2 * i))p" <<<"$ports")"
			done
		} >"$CLUSTER/cluster.conf"
	fi
	# shellcheck disable=SC1091
	source "$CLUSTER/cluster.conf"
	local pids=() i bp cp failed=0 brokers=""
	for i in "${NODES[@]}"; do
		bp=BROKER_PORT_$i cp=CONTROLLER_PORT_$i
		KAFKA_NODE_ID=$i KAFKA_BROKER_PORT=${!bp} KAFKA_CONTROLLER_PORT=${!cp} KAFKA_CLUSTER_ID=$CLUSTER_ID \
			KAFKA_QUORUM_VOTERS=$VOTERS KAFKA_REPLICATION=3 node "$i" start >"$CLUSTER/start-$i.out" &
		pids+=($!)
		brokers+="${brokers:+,}127.0.0.1:${!bp}"
	done
	for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; done
	((failed == 0)) || die "a node did not start (see $CLUSTER/node-*/kafka/server.log)"
	echo "KAFKA_BROKERS=$brokers"
}

case ${1:-} in
start) cmd_start ;;
stop) for i in "${NODES[@]}"; do node "$i" stop || true; done ;;
purge) for i in "${NODES[@]}"; do node "$i" purge & done; wait || true; rm -rf "$CLUSTER" ;; # all at once: each waits up to 30 s for its JVM
status) for i in "${NODES[@]}"; do node "$i" status || exit 1; done ;;
*) echo "usage: $0 {start|stop|purge|status}" >&2; exit 2 ;;
esac
