#!/usr/bin/env bash
# Single-node OpenSearch for the outboxrelay test stack: search.sh with OpenSearch's
# parameters (its header documents the commands, fetch|start|stop|purge|status|version).
# The env line is ELASTICSEARCH_URL=http://127.0.0.1:<port>; node state in $STACK_DIR/opensearch.
#
# Environment (besides search.sh's CACHE_DIR, STACK_DIR, JAVA_HOME, SEARCH_*):
#   OPENSEARCH_VERSION        default 2.19.6 (2.19.x is the newest line that runs on Java 17;
#                             its REST API is the Elasticsearch 7.10 API olivere/elastic v7 speaks)
#   OPENSEARCH_JAVA_OPTS      extra JVM flags (SEARCH_JAVA_OPTS)
#   OPENSEARCH_START_TIMEOUT  seconds to wait for yellow health (SEARCH_START_TIMEOUT), default 120
#   OPENSEARCH_CLUSTER_NAME   SEARCH_CLUSTER_NAME
set -euo pipefail

OPENSEARCH_VERSION=${OPENSEARCH_VERSION:-2.19.6}

export SEARCH_ENGINE=opensearch SEARCH_VERSION=$OPENSEARCH_VERSION SEARCH_PACKAGE=org.opensearch
export SEARCH_ENV_NAME=ELASTICSEARCH_URL
# The server (org.opensearch.node.Node and all of core) and the distribution's modules/ that
# Maven Central has, loaded as classpath plugins: Netty4 HTTP and transport, the standard
# analyzers, scaled_float/rank_feature/token_count, _reindex/_update_by_query/
# _delete_by_query, painless scripts, search templates, join fields, matrix_stats.
export SEARCH_ARTIFACTS="org.opensearch:opensearch
  org.opensearch.plugin:transport-netty4-client org.opensearch.plugin:analysis-common
  org.opensearch.plugin:mapper-extras-client org.opensearch.plugin:reindex-client
  org.opensearch.plugin:lang-painless org.opensearch.plugin:lang-mustache-client
  org.opensearch.plugin:parent-join-client org.opensearch.plugin:aggs-matrix-stats-client"
# optional in the opensearch pom, but LogConfigurator needs a log4j2 backend (the version
# the opensearch pom names)
export SEARCH_EXTRA_ARTIFACTS="org.apache.logging.log4j:log4j-core:2.25.4"
export SEARCH_PLUGINS="org.opensearch.transport.Netty4Plugin
  org.opensearch.analysis.common.CommonAnalysisPlugin
  org.opensearch.index.mapper.MapperExtrasPlugin
  org.opensearch.index.reindex.ReindexPlugin
  org.opensearch.painless.PainlessPlugin
  org.opensearch.script.mustache.MustachePlugin
  org.opensearch.join.ParentJoinPlugin
  org.opensearch.search.aggregations.matrix.MatrixAggregationPlugin"
[[ -n ${OPENSEARCH_JAVA_OPTS:-} ]] && export SEARCH_JAVA_OPTS=$OPENSEARCH_JAVA_OPTS
[[ -n ${OPENSEARCH_START_TIMEOUT:-} ]] && export SEARCH_START_TIMEOUT=$OPENSEARCH_START_TIMEOUT
[[ -n ${OPENSEARCH_CLUSTER_NAME:-} ]] && export SEARCH_CLUSTER_NAME=$OPENSEARCH_CLUSTER_NAME
exec bash "$(dirname "${BASH_SOURCE[0]}")/search.sh" "$@"
