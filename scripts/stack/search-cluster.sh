#!/usr/bin/env bash
# A 2-node search cluster for the failover tests: node 1 is the cluster manager (and holds
# data), node 2 holds data only, so killing node 2 never costs the cluster its manager (with
# two manager-eligible nodes the voting configuration is one of them, and losing that one
# stops the cluster). Both hold data, so an index with one replica is green. Discovery is
# unicast on loopback (discovery.seed_hosts = both transport ports); node 1 bootstraps the
# cluster (cluster.initial_cluster_manager_nodes). Each node is a search.sh state in
# $STACK_DIR/search-cluster/node-<n>, so one node can be stopped (or killed: its pid is in
# node-<n>/<engine>/<engine>.pid) and started again on its own:
#   STACK_DIR=$STACK_DIR/search-cluster/node-2 opensearch.sh start
#
# Usage: scripts/stack/search-cluster.sh {start|stop|purge|status}
#   start  starts both nodes and waits for a green cluster; prints
#          ELASTICSEARCH_URL=http://127.0.0.1:<http1>,http://127.0.0.1:<http2> last
#          (the comma list ELASTICSEARCH_URL takes)
# Environment:
#   SEARCH_CLUSTER_ENGINE  opensearch (default) or elasticsearch (7.x: master/initial_master_nodes)
#   SEARCH_JAVA_OPTS       default -Xms512m -Xmx512m here
#   and what opensearch.sh / elasticsearch.sh read.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/../.." && pwd)
STACK_DIR=$(realpath -m -- "${STACK_DIR:-$REPO/.stack}")
CLUSTER=$STACK_DIR/search-cluster
ENGINE=${SEARCH_CLUSTER_ENGINE:-opensearch}
NODES=(1 2)
export SEARCH_JAVA_OPTS=${SEARCH_JAVA_OPTS:--Xms512m -Xmx512m}
START_TIMEOUT=${SEARCH_START_TIMEOUT:-180}

case $ENGINE in
opensearch) manager_role=cluster_manager initial=cluster.initial_cluster_manager_nodes ;;
elasticsearch) manager_role=master initial=cluster.initial_master_nodes ;;
*) echo "search-cluster.sh: SEARCH_CLUSTER_ENGINE=$ENGINE: want opensearch or elasticsearch" >&2; exit 2 ;;
esac

log() { echo "search-cluster.sh: $*" >&2; }
die() { log "$*"; exit 1; }

node() { # N VERB
	STACK_DIR=$CLUSTER/node-$1 bash "$SCRIPT_DIR/$ENGINE.sh" "$2"
}

cmd_start() {
	mkdir -p "$CLUSTER"
	bash "$SCRIPT_DIR/$ENGINE.sh" fetch
	if [[ ! -f $CLUSTER/cluster.conf ]]; then
		local ports
		ports=$(python3 "$SCRIPT_DIR/freeport.py" 4) || die "cannot pick free ports"
		mapfile -t ports <<<"$ports"
		((${#ports[@]} == 4)) || die "cannot pick free ports"
		{
			echo "HTTP_PORT_1=${ports[0]} TRANSPORT_PORT_1=${ports[1]}"
			echo "HTTP_PORT_2=${ports[2]} TRANSPORT_PORT_2=${ports[3]}"
			echo "CLUSTER_NAME=outboxrelay-cluster-$(head -c6 /dev/urandom | od -An -tx1 | tr -d ' \n')"
		} >"$CLUSTER/cluster.conf"
	fi
	# shellcheck disable=SC1091
	source "$CLUSTER/cluster.conf"
	local seeds="127.0.0.1:$TRANSPORT_PORT_1,127.0.0.1:$TRANSPORT_PORT_2"
	local -A roles=([1]="$manager_role,data,ingest" [2]="data,ingest")
	local pids=() i hp tp failed=0 urls=""
	# Both at once: node 2's start waits until it has joined node 1's cluster.
	for i in "${NODES[@]}"; do
		hp=HTTP_PORT_$i tp=TRANSPORT_PORT_$i
		SEARCH_CLUSTER_NAME=$CLUSTER_NAME SEARCH_NODE_NAME=outboxrelay-node-$i SEARCH_PORTS="${!hp} ${!tp}" \
			SEARCH_SETTINGS="discovery.seed_hosts=$seeds $initial=outboxrelay-node-1 node.roles=${roles[$i]}" \
			SEARCH_START_TIMEOUT=$START_TIMEOUT node "$i" start >"$CLUSTER/start-$i.out" &
		pids+=($!)
		urls+="${urls:+,}http://127.0.0.1:${!hp}"
	done
	for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; done
	((failed == 0)) || die "a node did not start (see $CLUSTER/node-*/$ENGINE/logs/)"
	curl -sf --max-time $((START_TIMEOUT + 10)) \
		"http://127.0.0.1:$HTTP_PORT_1/_cluster/health?wait_for_nodes=2&wait_for_status=green&timeout=${START_TIMEOUT}s" >/dev/null ||
		die "the cluster did not reach 2 nodes and green health in ${START_TIMEOUT}s"
	echo "ELASTICSEARCH_URL=$urls"
}

case ${1:-} in
start) cmd_start ;;
stop) for i in 2 1; do node "$i" stop || true; done ;;
purge) for i in "${NODES[@]}"; do node "$i" purge & done; wait || true; rm -rf "$CLUSTER" ;; # data is thrown away: nodes at once
status) for i in "${NODES[@]}"; do node "$i" status || exit 1; done ;;
*) echo "usage: $0 {start|stop|purge|status}" >&2; exit 2 ;;
esac
