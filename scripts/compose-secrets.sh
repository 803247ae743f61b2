#!/usr/bin/env sh
# Makes the passwords docker-compose.secure.yml reads as Compose secrets:
#
#   scripts/compose-secrets.sh [DIR]      # DIR defaults to ./secrets (beside the compose files)
#
# Each is 32 random bytes in hex (nothing to escape in a URL, a pgpass line
# or Kafka's SCRAM syntax). A file that exists is kept, so running it again
# changes nothing; delete DIR to start over (and the compose volumes, which
# hold the hashes: docker compose ... down -v).
#
#   postgres_password.txt  the outboxrelay database user's (POSTGRES_PASSWORD_FILE)
#   pgpass                 the same for the clients (passfile= in DATABASE_URL)
#   kafka_password.txt     the SCRAM-SHA-512 user outboxrelay (KAFKA_SASL_PASSWORD_FILE)
#   search_password.txt    basic auth of outboxrelay at search-proxy (ELASTICSEARCH_PASSWORD_FILE)
#   search_htpasswd        its hash, for nginx
#   metrics_password.txt   basic auth of prometheus on /metrics (METRICS_PASSWORD_FILE)
#
# DIR is mode 0700, so other users of this machine cannot read it; the
# files are 0444 because Compose bind-mounts them with their owner on this
# machine, and each container reads them as its own user (kafka-users as
# 1000, the services as 65532, nginx's workers as 101, Prometheus as 65534).
# The TLS keys are not here: the compose `certs` job makes them in volumes.
set -eu

dir=${1:-$(cd "$(dirname "$0")/.." && pwd)/secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"

# password FILE: a new password in FILE unless it exists.
password() {
	if [ ! -s "$dir/$1" ]; then
		openssl rand -hex 32 >"$dir/$1.tmp"
		mv "$dir/$1.tmp" "$dir/$1"
	fi
	chmod 444 "$dir/$1"
}

password postgres_password.txt
password kafka_password.txt
password search_password.txt
password metrics_password.txt

# The host, port, database and user of DATABASE_URL in docker-compose.secure.yml.
if [ ! -s "$dir/pgpass" ]; then
	printf 'postgres:5432:outboxrelay:outboxrelay:%s\n' "$(cat "$dir/postgres_password.txt")" >"$dir/pgpass"
fi
chmod 444 "$dir/pgpass"

# ELASTICSEARCH_USERNAME of the indexer.
if [ ! -s "$dir/search_htpasswd" ]; then
	printf 'outboxrelay:%s\n' "$(openssl passwd -apr1 -stdin <"$dir/search_password.txt")" >"$dir/search_htpasswd"
fi
chmod 444 "$dir/search_htpasswd"

echo "secrets in $dir"
