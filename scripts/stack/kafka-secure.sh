#!/usr/bin/env bash
# A Kafka broker with secured listeners beside the plaintext one, for the
# security tests (stack.Private(t, "kafka-secure")): kafka.sh with
# KAFKA_SECURE=1. Same commands as kafka.sh; see its header.
set -euo pipefail
KAFKA_SECURE=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/kafka.sh" "$@"
