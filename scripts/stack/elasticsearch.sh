#!/usr/bin/env bash
# Single-node Elasticsearch 7.17 for the outboxrelay test stack, the second engine beside
# OpenSearch: search.sh with Elasticsearch's parameters (its header documents the commands,
# fetch|start|stop|purge|status|version). The env line is ELASTICSEARCH7_URL=http://127.0.0.1:<port>,
# so both engines can be exported; node state in $STACK_DIR/elasticsearch.
#
# Maven Central has the server and only these module "client" jars for 7.17: no
# analysis-common, painless or x-pack. So this node has the core analyzers only (standard,
# simple, whitespace, keyword, stop; the language analyzers are in analysis-common) and no
# scripting; sink/mapping.json uses neither.
#
# Environment (besides search.sh's CACHE_DIR, STACK_DIR, JAVA_HOME, SEARCH_*):
#   ELASTICSEARCH_VERSION        default 7.17.29 (the line olivere/elastic v7 speaks; runs on Java 17)
#   ELASTICSEARCH_JAVA_OPTS      extra JVM flags (SEARCH_JAVA_OPTS)
#   ELASTICSEARCH_START_TIMEOUT  seconds to wait for yellow health (SEARCH_START_TIMEOUT), default 120
#   ELASTICSEARCH_CLUSTER_NAME   SEARCH_CLUSTER_NAME
set -euo pipefail

ELASTICSEARCH_VERSION=${ELASTICSEARCH_VERSION:-7.17.29}

export SEARCH_ENGINE=elasticsearch SEARCH_VERSION=$ELASTICSEARCH_VERSION SEARCH_PACKAGE=org.elasticsearch
export SEARCH_ENV_NAME=ELASTICSEARCH7_URL
export SEARCH_ARTIFACTS="org.elasticsearch:elasticsearch
  org.elasticsearch.plugin:transport-netty4-client org.elasticsearch.plugin:mapper-extras-client
  org.elasticsearch.plugin:reindex-client"
export SEARCH_EXTRA_ARTIFACTS="org.apache.logging.log4j:log4j-core:2.17.1"
# ReindexPlugin moved package in 7.17; the older name keeps earlier 7.x versions working.
export SEARCH_PLUGINS="org.elasticsearch.transport.Netty4Plugin
  org.elasticsearch.index.mapper.MapperExtrasPlugin
  org.elasticsearch.reindex.ReindexPlugin
  org.elasticsearch.index.reindex.ReindexPlugin"
[[ -n ${ELASTICSEARCH_JAVA_OPTS:-} ]] && export SEARCH_JAVA_OPTS=$ELASTICSEARCH_JAVA_OPTS
[[ -n ${ELASTICSEARCH_START_TIMEOUT:-} ]] && export SEARCH_START_TIMEOUT=$ELASTICSEARCH_START_TIMEOUT
[[ -n ${ELASTICSEARCH_CLUSTER_NAME:-} ]] && export SEARCH_CLUSTER_NAME=$ELASTICSEARCH_CLUSTER_NAME
exec bash "$(dirname "${BASH_SOURCE[0]}")/search.sh" "$@"
