#!/usr/bin/env bash
# certs.sh: the TLS material for etcd and leasehold, made with openssl.
#
#   deploy/etcd/certs.sh OUTDIR CLUSTER...
#
# writes, under OUTDIR (created mode 0700; keys 0600):
#   ca.crt, ca.key                     a CA for etcd's server and client certificates
#   server.crt, server.key             etcd's server certificate: SAN 127.0.0.1, ::1, localhost,
#                                      plus $ETCD_SERVER_SANS (e.g. "DNS:etcd-1.example.internal,IP:10.0.0.11")
#   clients/root.crt, .key             CN=root: the etcd administrator, for etcd-rbac.sh
#   clients/leasehold-<CLUSTER>.crt    one per cluster, CN=leasehold-<CLUSTER>: with etcd's
#   clients/leasehold-<CLUSTER>.key    --client-cert-auth, etcd takes the user name from the
#                                      CN, so the agents act as the user etcd-rbac.sh creates
#
# Existing files are kept (a second run adds new clusters with the same CA). Delete a file to
# have it made again. Environment: DAYS (client and server validity, default 825),
# CA_DAYS (default 3650), OPENSSL (default openssl).
#
# etcd then runs with (see deploy/README.md):
#   --cert-file OUTDIR/server.crt --key-file OUTDIR/server.key
#   --trusted-ca-file OUTDIR/ca.crt --client-cert-auth
set -euo pipefail

usage() {
  echo "usage: $0 OUTDIR CLUSTER..." >&2
  echo "  e.g. $0 ./pki cluster-a cluster-b" >&2
  exit 2
}
[ $# -ge 2 ] || usage
out=$1
shift

OPENSSL=${OPENSSL:-openssl}
DAYS=${DAYS:-825}
CA_DAYS=${CA_DAYS:-3650}
umask 077

# Cluster IDs become etcd user names and key prefixes; leasehold accepts the same characters.
for c in "$@"; do
  if ! [[ $c =~ ^[A-Za-z0-9][A-Za-z0-9._:@-]*$ ]] || [ ${#c} -gt 200 ]; then
    echo "certs.sh: cluster ID \"$c\" is not valid: letters, digits and . _ : @ - only, starting with a letter or digit" >&2
    exit 2
  fi
done

mkdir -p "$out/clients"
chmod 0700 "$out" "$out/clients"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# key FILE: a new P-256 private key (PKCS#8 PEM).
key() {
  "$OPENSSL" genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

# sign NAME CN EXTENSIONS: OUTDIR/NAME.crt for OUTDIR/NAME.key, signed by the CA.
sign() {
  local name=$1 cn=$2 ext=$3
  local crt="$out/$name.crt" k="$out/$name.key"
  if [ -s "$crt" ] && [ -s "$k" ]; then
    echo "kept    $crt"
    return
  fi
  key "$k"
  printf '%b\n' "$ext" >"$work/ext.cnf"
  "$OPENSSL" req -new -key "$k" -subj "/CN=$cn" -out "$work/req.csr"
  "$OPENSSL" x509 -req -in "$work/req.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$out/ca.srl" -days "$DAYS" -sha256 \
    -extfile "$work/ext.cnf" -out "$crt" 2>/dev/null
  chmod 0644 "$crt"
  echo "made    $crt (CN=$cn)"
}

if [ -s "$out/ca.crt" ] && [ -s "$out/ca.key" ]; then
  echo "kept    $out/ca.crt"
else
  key "$out/ca.key"
  "$OPENSSL" req -x509 -new -key "$out/ca.key" -subj "/CN=leasehold etcd CA" -days "$CA_DAYS" -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$out/ca.crt"
  chmod 0644 "$out/ca.crt"
  echo "made    $out/ca.crt"
fi

# etcd's server certificate also carries clientAuth: etcd's own gRPC gateway connects to
# its client port with it, and with --client-cert-auth that connection needs a client EKU.
sans="IP:127.0.0.1,IP:::1,DNS:localhost"
[ -z "${ETCD_SERVER_SANS:-}" ] || sans="$sans,$ETCD_SERVER_SANS"
sign server etcd "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=$sans"

client_ext="basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth"
sign clients/root root "$client_ext"
for c in "$@"; do
  sign "clients/leasehold-$c" "leasehold-$c" "$client_ext"
done

echo
echo "etcd:     --cert-file $out/server.crt --key-file $out/server.key --trusted-ca-file $out/ca.crt --client-cert-auth"
echo "etcdctl:  --cacert $out/ca.crt --cert $out/clients/root.crt --key $out/clients/root.key"
for c in "$@"; do
  echo "cluster $c (Kubernetes):"
  echo "  kubectl -n leasehold create secret generic leasehold-etcd --from-file=ca.crt=$out/ca.crt \\"
  echo "    --from-file=tls.crt=$out/clients/leasehold-$c.crt --from-file=tls.key=$out/clients/leasehold-$c.key"
done
