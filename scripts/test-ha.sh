#!/usr/bin/env bash
# Automatic failover on a real three-node Pacemaker/Corosync cluster (docs/ha.md, "The test"):
# three nodes on this machine, each in its own network, mount and UTS namespace; the pool as
# an ocf:rpmemfs:rpmemfs promotable clone; rounds of killing and partitioning the primary
# node. Needs root. Installs rpmemfs (as scripts/install.sh does) and pacemaker, corosync.
# Its last line: "failovers: N, acked lost: L, max failover seconds: S". Arguments go to
# tests/ha/failover.py (--rounds N, default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "test-ha.sh: needs root (network namespaces, FUSE mounts, corosync)" >&2
  exit 1
fi
scripts/install.sh
. scripts/progress.sh
PKGS=(pacemaker pacemaker-cli-utils corosync)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "updating Debian's package lists" apt-get update -qq
  # Nothing is started: the test runs corosync and pacemakerd itself, in its namespaces.
  step "installing ${missing[*]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${missing[@]}"
fi
exec .venv/bin/python -m tests.ha.failover "$@"
