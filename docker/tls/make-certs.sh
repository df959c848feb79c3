#!/bin/sh
# The TLS profile's certificates (docker-compose.yml, service tls-certs), made once: a CA of the stack's own and
# one certificate for the replicas, whose subjectAltName names every replica, localhost and 127.0.0.1 (clients
# reach the replicas through the balancer's published port, TLS passing through it untouched). The CA's key is
# deleted once it has signed: to renew, remove the volume (docker compose --profile tls down -v) and start again.
# Clients trust ca.pem:   docker compose cp tls-certs:/certs/ca.pem ./ca.pem
#   CERTS_DIR    where to write (default /certs, the tls-certs volume)
#   TLS_NAMES    comma-separated DNS names for the certificate (default proxy-tls-1,proxy-tls-2,localhost)
#   CERTS_OWNER  uid that must read the key (default 10001, the image's vllm user)
set -eu
dir="${CERTS_DIR:-/certs}"
names="${TLS_NAMES:-proxy-tls-1,proxy-tls-2,localhost}"
if [ -s "$dir/replica.pem" ] && [ -s "$dir/replica.key" ] && [ -s "$dir/ca.pem" ]; then
  echo "tls-certs: keeping the certificates in $dir"
  exit 0
fi
umask 077
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
# shellcheck disable=SC2086 # $ec is several arguments
openssl req -x509 $ec -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 3650 -subj "/CN=vllm-etcd-proxy compose CA"
sans="IP:127.0.0.1"
for name in $(echo "$names" | tr ',' ' '); do
  sans="$sans,DNS:$name"
done
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$sans" > "$dir/replica.ext"
# shellcheck disable=SC2086
openssl req $ec -keyout "$dir/replica.key" -out "$dir/replica.csr" -subj "/CN=vllm-proxy"
openssl x509 -req -in "$dir/replica.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
  -out "$dir/replica.pem" -days 825 -extfile "$dir/replica.ext"
rm -f "$dir/ca.key" "$dir/ca.srl" "$dir/replica.csr" "$dir/replica.ext"
chmod 644 "$dir/ca.pem" "$dir/replica.pem"
chown "${CERTS_OWNER:-10001}" "$dir/replica.key" 2>/dev/null || true
echo "tls-certs: made $dir/ca.pem and $dir/replica.pem for $sans"
