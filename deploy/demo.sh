#!/usr/bin/env bash
# make demo: leaseholdd on an embedded etcd in a temporary directory, the real plugin binary
# for a handful of dual-stack containers, the state as leaseholdctl and etcdctl show it, a few
# DELs, and a clean stop. Needs no root.
#
# DEMO_KEEP=1 (make demo DEMO_KEEP=1) skips the stop: leaseholdd and its etcd keep running, so
# the etcdctl and leaseholdctl commands of README.md and docs/ can be pasted against pool net1
# of node node-a; $work/env sets ETCDCTL_ENDPOINTS and PATH for them, and the last lines say how
# to stop. integration/doccheck_test.go runs those commands against this state.
set -euo pipefail
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/bin}
work=$(mktemp -d "${TMPDIR:-/tmp}/leasehold-demo.XXXXXX")
agent_pid=""
kept=""
cleanup() {
  [ -n "$kept" ] && return
  if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
    kill -INT "$agent_pid"
    for _ in $(seq 1 100); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Free loopback ports for the embedded etcd, so the demo never collides with a real etcd on 2379.
free_port() { # first port from $1 up that nothing listens on
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}
cport=$(free_port 23790)
pport=$(free_port $((cport + 1)))
endpoint="http://127.0.0.1:${cport}"
sock="$work/leaseholdd.sock"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "starting leaseholdd with an embedded etcd in $work/etcd (client URL $endpoint)"
# The containers have no network namespace (no root): without --liveness-interval 0s the agent
# would take them for gone --liveness-grace after their ADD and release them.
"$BIN/leaseholdd" --embedded-etcd "$work/etcd" --embedded-etcd-client-url "$endpoint" \
  --embedded-etcd-peer-url "http://127.0.0.1:${pport}" --socket "$sock" --node node-a \
  --node-uid demo-uid --state-dir "$work/state" --quarantine 5s --liveness-interval 0s \
  --metrics-addr "" --log-level warn >"$work/leaseholdd.log" 2>&1 &
agent_pid=$!
for _ in $(seq 1 300); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "leaseholdd did not start:"; cat "$work/leaseholdd.log"; exit 1; }

conf=$(cat <<JSON
{"cniVersion":"1.1.0","name":"net1","type":"leasehold",
 "ipam":{"type":"leasehold","socket":"$sock",
   "ranges":[[{"subnet":"10.10.0.0/16","rangeStart":"10.10.1.0","rangeEnd":"10.10.9.255","gateway":"10.10.0.1"}],
             [{"subnet":"fd10::/64"}]],
   "exclude":["10.10.1.0/28"],
   "routes":[{"dst":"0.0.0.0/0"},{"dst":"::/0"}]}}
JSON
)
cni() { # cni COMMAND CONTAINER POD
  CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=/var/run/netns/$2 CNI_IFNAME=eth0 CNI_PATH="$BIN/cni" \
  CNI_ARGS="K8S_POD_UID=uid-$3;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=$3" "$BIN/leasehold" <<<"$conf"
}

addresses() { grep -o '"address": *"[^"]*"' | sed 's/.*: *"\(.*\)"/\1/' | paste -sd, - | sed 's/,/, /g'; }

say "CNI ADD for five containers through the real plugin binary ($BIN/leasehold)"
for i in 1 2 3 4 5; do
  printf 'web-%s: ' "$i"
  cni ADD "ctr-web-$i" "web-$i" | addresses
done

say "ADD again for web-3: same container, same addresses (idempotent)"
cni ADD ctr-web-3 web-3 | addresses

say "leaseholdctl pool list"
"$BIN/leaseholdctl" --endpoints "$endpoint" pool list
say "leaseholdctl alloc list"
"$BIN/leaseholdctl" --endpoints "$endpoint" alloc list

say "raw keys, as plain etcdctl shows them: etcdctl get --prefix /leasehold/v1/ --keys-only"
"$BIN/etcdctl" --endpoints "$endpoint" get --prefix /leasehold/v1/ --keys-only | sed '/^$/d'
say "one allocation's value and its lease"
key=$("$BIN/etcdctl" --endpoints "$endpoint" get --prefix /leasehold/v1/ips/net1/10. --keys-only --limit 1 | sed -n 1p)
"$BIN/etcdctl" --endpoints "$endpoint" get "$key" --print-value-only
lease=$("$BIN/etcdctl" --endpoints "$endpoint" get "$key" --print-value-only | sed -n 's/.*"leaseID":"\([0-9a-f]*\)".*/\1/p')
"$BIN/etcdctl" --endpoints "$endpoint" lease timetolive "$lease" --keys

say "CHECK web-1, then DEL web-1 and web-2"
cni CHECK ctr-web-1 web-1 && echo "web-1: CHECK ok"
cni DEL ctr-web-1 web-1 && echo "web-1: released"
cni DEL ctr-web-2 web-2 && echo "web-2: released"

say "after DEL: allocations left, and the released addresses resting in quarantine"
"$BIN/leaseholdctl" --endpoints "$endpoint" alloc list
"$BIN/etcdctl" --endpoints "$endpoint" get --prefix /leasehold/v1/quarantine/ --keys-only | sed '/^$/d'

if [ -n "${DEMO_KEEP:-}" ]; then
  printf 'export ETCDCTL_ENDPOINTS=%s\nexport PATH="%s:$PATH"\n' "$endpoint" "$BIN" >"$work/env"
  echo "$agent_pid" >"$work/leaseholdd.pid"
  say "leaseholdd keeps running (DEMO_KEEP): pid $agent_pid, etcd at $endpoint, its files in $work"
  echo "For the commands of README.md and docs/:  . $work/env"
  echo "To stop it:  kill -INT $agent_pid && rm -rf $work"
  kept=1
  exit 0
fi

say "stopping leaseholdd"
kill -INT "$agent_pid"
wait "$agent_pid" && echo "leaseholdd stopped cleanly"
agent_pid=""
