#!/usr/bin/env bash
# etcd-rbac.sh: one etcd user and role per cluster, limited to what leasehold's agents of
# that cluster use under /leasehold/v1/.
#
#   deploy/etcd/etcd-rbac.sh [--enable-auth] CLUSTER...
#
# For each CLUSTER it makes role and user "leasehold-<CLUSTER>" (the CN of the client
# certificate deploy/etcd/certs.sh makes for it) and grants the role exactly these key
# prefixes (etcd prefix permissions, --prefix=true):
#
#   readwrite  /leasehold/v1/ips/                    allocations of every pool       (shared)
#   readwrite  /leasehold/v1/quarantine/             released addresses resting      (shared)
#   readwrite  /leasehold/v1/pools/                  pool definitions                (shared)
#   readwrite  /leasehold/v1/hostips/                addresses nodes use themselves  (shared)
#   readwrite  /leasehold/v1/poolconflicts/          pool definitions nodes disagree with (shared)
#   readwrite  /leasehold/v1/blocks/                 which node claimed which block  (shared)
#   readwrite  /leasehold/v1/held/                   addresses held back after expiry (shared)
#   readwrite  /leasehold/v1/wanted/                 conflicted addresses a running pod wants back (shared)
#   readwrite  /leasehold/v1/owners/<CLUSTER>/       this cluster's owner indexes
#   readwrite  /leasehold/v1/nodes/<CLUSTER>/        this cluster's agents and pod records
#   readwrite  /leasehold/v1/conflicts/<CLUSTER>/    this cluster's conflict records
#   readwrite  /leasehold/v1/claims/<CLUSTER>/       this cluster's sticky claims
#   readwrite  /leasehold/v1/livemigrations/<CLUSTER>/  this cluster's live migrations' targets
#   read       /leasehold/v1/selection/<CLUSTER>/    this cluster's selection rules (admins write them)
#
# Why the first eight are shared: pools are shared across clusters by design. An address is
# taken by creating ips/<pool>/<block>/<ip> only if it, its quarantine/ key and every
# hostips/<ip>/ key are absent, in one transaction; every agent of every cluster using the
# pool must read and write those keys, or two clusters could hand out one address. A pool's
# definition is written by the first agent that uses it (read it, and write it on creation);
# a node that wants it defined otherwise records that under poolconflicts/<pool>/, which
# every agent using the pool watches, whatever its cluster. A block of a pool is claimed by
# one node of one cluster under blocks/<pool>/<block>; every cluster's agents read the claims
# to find a free block. A pod's held/<pool>/<block>/<ip> key outlives its allocation when its
# node is cut off, and every cluster's agents read it to leave that address to its node; so
# with wanted/<pool>/<block>/<ip>/..., which leaves a conflicted address to its running pod.
# Releasing an address deletes its ips/ key and writes its quarantine/ key, and etcd only
# revokes a lease (which deletes its keys) for a user that may write every key on it.
# The per-cluster prefixes carry a trailing slash, so cluster "a" is not granted "a-b".
#
# What this does not protect: a cluster's credentials can rewrite or delete other clusters'
# allocations in a shared pool (never create a duplicate: the agents' transactions compare).
# Clusters that must not trust each other need separate etcd clusters.
#
# With LEASEHOLD_ETCD_PASSWORD set (exactly one CLUSTER), the user gets that password, for
# leaseholdd --etcd-username; otherwise it has none and authenticates by its client
# certificate alone (etcd --client-cert-auth; etcd 3.5 or later).
#
# --enable-auth: afterwards, make sure user root exists with role root and turn on etcd
# authentication. root gets $ETCD_ROOT_PASSWORD; without it, root has no password, which is
# only usable with --client-cert-auth and a CN=root client certificate (certs.sh makes one),
# so then the connection this script uses must present one (ETCDCTL_CERT).
#
# Connection: the usual etcdctl environment, e.g.
#   ETCDCTL_ENDPOINTS=https://127.0.0.1:2379 ETCDCTL_CACERT=pki/ca.crt \
#   ETCDCTL_CERT=pki/clients/root.crt ETCDCTL_KEY=pki/clients/root.key \
#   deploy/etcd/etcd-rbac.sh --enable-auth cluster-a cluster-b
# (ETCDCTL_USER=root:password once auth is on and root has a password). ETCDCTL names the
# etcdctl binary (default: etcdctl). Running it again changes nothing that is already right.
set -euo pipefail

PREFIX=/leasehold/v1/
ETCDCTL=${ETCDCTL:-etcdctl}

usage() {
  echo "usage: $0 [--enable-auth] CLUSTER..." >&2
  exit 2
}

enable_auth=false
clusters=()
for a in "$@"; do
  case $a in
  --enable-auth) enable_auth=true ;;
  -h | --help) usage ;;
  -*) echo "etcd-rbac.sh: unknown option $a" >&2; usage ;;
  *) clusters+=("$a") ;;
  esac
done
[ ${#clusters[@]} -gt 0 ] || usage
if [ -n "${LEASEHOLD_ETCD_PASSWORD:-}" ] && [ ${#clusters[@]} -ne 1 ]; then
  echo "etcd-rbac.sh: LEASEHOLD_ETCD_PASSWORD is one user's password: give exactly one CLUSTER" >&2
  exit 2
fi
# etcdctl reads a password from stdin with scanf("%s"): it would keep only the first word.
for v in LEASEHOLD_ETCD_PASSWORD ETCD_ROOT_PASSWORD; do
  if [[ ${!v:-} =~ [[:space:]] ]]; then
    echo "etcd-rbac.sh: $v contains whitespace, which etcdctl would cut off; choose another password" >&2
    exit 2
  fi
done
for c in "${clusters[@]}"; do
  # The same rule as leasehold's key components (allocator.ValidateName): no / or spaces.
  if ! [[ $c =~ ^[A-Za-z0-9][A-Za-z0-9._:@-]*$ ]] || [ ${#c} -gt 200 ]; then
    echo "etcd-rbac.sh: cluster ID \"$c\" is not valid: letters, digits and . _ : @ - only, starting with a letter or digit" >&2
    exit 2
  fi
done

ctl() { "$ETCDCTL" "$@"; }

# exists KIND NAME: whether the user or role exists (etcdctl's answer is otherwise an error).
exists() { ctl "$1" get "$2" >/dev/null 2>&1; }

for c in "${clusters[@]}"; do
  name="leasehold-$c"
  exists role "$name" || ctl role add "$name"
  # Keep in step with keyspace.RolePrefixes and keyspace.ReadPrefixes
  # (integration/deploy_scripts_test.go compares them).
  for p in pools/ ips/ quarantine/ hostips/ poolconflicts/ blocks/ held/ wanted/ "owners/$c/" "nodes/$c/" "conflicts/$c/" "claims/$c/" "livemigrations/$c/"; do
    ctl role grant-permission --prefix=true "$name" readwrite "$PREFIX$p"
  done
  # The agents follow the selection rules; leaseholdctl, with an admin's credentials, writes them.
  ctl role grant-permission --prefix=true "$name" read "${PREFIX}selection/$c/"
  if ! exists user "$name"; then
    if [ -n "${LEASEHOLD_ETCD_PASSWORD:-}" ]; then
      # On stdin, not on the command line, where every local user could read it.
      printf '%s\n' "$LEASEHOLD_ETCD_PASSWORD" | ctl user add "$name" --interactive=false
    else
      ctl user add "$name" --no-password
    fi
  elif [ -n "${LEASEHOLD_ETCD_PASSWORD:-}" ]; then
    printf '%s\n' "$LEASEHOLD_ETCD_PASSWORD" | ctl user passwd "$name" --interactive=false
  fi
  ctl user grant-role "$name" "$name"
  ctl role get "$name"
done

if $enable_auth; then
  if ! exists user root; then
    if [ -n "${ETCD_ROOT_PASSWORD:-}" ]; then
      printf '%s\n' "$ETCD_ROOT_PASSWORD" | ctl user add root --interactive=false
    elif [ -n "${ETCDCTL_CERT:-}" ]; then
      ctl user add root --no-password
    else
      echo "etcd-rbac.sh: --enable-auth needs ETCD_ROOT_PASSWORD, or a CN=root client certificate in ETCDCTL_CERT;" >&2
      echo "  a root user with neither could never log in again" >&2
      exit 2
    fi
  fi
  ctl user grant-role root root
  ctl auth enable
fi
