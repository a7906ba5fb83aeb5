#!/usr/bin/env bash
# The machine's part of `make test`: the programs its tests drive besides Go and the tools
# `make tools` builds. Every test that needs one of them runs in `make test`, so a missing one
# is installed here (root with apt-get, as on the Debian machines CI and the README assume) or
# named with the one command that installs it; `make test` never quietly skips a part of itself.
# Used by `make test` and by .ci/run.
set -euo pipefail

# command the tests run : Debian package that has it
needs=(
  "ip:iproute2"                        # network namespaces and veth pairs
  "iptables:iptables"                  # partitions between agents and etcd
  "openssl:openssl"                    # deploy/etcd/certs.sh, TLS tests
  "containerd:containerd"              # the CRI test: a containerd of its own
  "containerd-shim-runc-v2:containerd"
  "ctr:containerd"
  "runc:runc"
  "busybox:busybox-static"             # the CRI test's sandbox image, made from local files
  "jq:jq"                              # docs/operations.md's etcdctl recipes, run by TestDocCommands
)

missing=()
for n in "${needs[@]}"; do
  cmd=${n%%:*} pkg=${n#*:}
  if ! command -v "$cmd" >/dev/null 2>&1; then
    [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
  fi
done
# The sandbox image is a static busybox: Debian's busybox package is dynamic and would
# install a `busybox` command the image cannot use.
if command -v dpkg >/dev/null 2>&1 && ! dpkg -s busybox-static >/dev/null 2>&1; then
  [[ " ${missing[*]-} " == *" busybox-static "* ]] || missing+=(busybox-static)
fi

if [ "$EUID" -ne 0 ]; then
  echo "make test runs tests that need root (network namespaces, a containerd of its own, the fault run)." >&2
  echo "Run it as root: sudo make test   (make test-unit runs the tests that need neither root nor etcd)" >&2
  exit 1
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if command -v apt-get >/dev/null 2>&1; then
  echo "make test: installing ${missing[*]} (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
  exit 0
fi
echo "make test needs the Debian packages ${missing[*]} (or their programs on PATH); no apt-get here." >&2
echo "Install them with your package manager, then run make test again." >&2
exit 1
