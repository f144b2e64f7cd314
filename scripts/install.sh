#!/usr/bin/env bash
# Installs what rpmemfs needs on a Debian machine: system packages, a virtual environment in
# .venv, and the package itself (its native helper is compiled here, by cffi).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh

# libssl-dev: the native helper seals protected connections with libcrypto (native/rpmem_sec.c).
PKGS=(fuse3 libfuse3-dev libssl-dev pkg-config gcc python3-dev python3-venv git sqlite3 tar psmisc patch)
# The tests also run a real Prometheus server and promtool against the metrics and alert rules,
# systemd-analyze against the units, setfacl/getfacl on the mount and on a tmpfs beside it, and
# ocf-tester (resource-agents; xmllint checks the meta-data) against the Pacemaker agent.
for arg in "$@"; do [ "$arg" = --test ] && PKGS+=(prometheus systemd acl resource-agents libxml2-utils); done
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  step "updating Debian's package lists" $SUDO apt-get update -qq
  step "installing ${missing[*]}" env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
step "updating pip in .venv" .venv/bin/python -m pip install -q --upgrade pip
extras=""
system=0
for arg in "$@"; do
  case "$arg" in
    # The package's extras, "[test]", "[plot]" or "[test,plot]"; plot is matplotlib, for the
    # plot `rpmemfs timeline` draws (nothing else needs it).
    --test | --plot) extras="${extras:+${extras%]},}${arg#--}]"; extras="[${extras#[}" ;;
    --system) system=1 ;;
  esac
done
# pyfuse3 with the operations it lacks (fallocate, lseek, copy_file_range, DONT_MASK...):
# patches/pyfuse3-3.5.0.patch on its sdist, built once per patch (PyPI has no wheel of 3.5.0)
# and handed to pip with the package, so the unpatched sdist is never built.
pyfuse3_wheel=$(scripts/build-pyfuse3.sh .venv/bin/python --wheel)
step "installing rpmemfs${extras} and its Python dependencies into .venv" \
  .venv/bin/python -m pip install -q -e ".${extras}" "$pyfuse3_wheel"
# Stamps the patch's hash beside pyfuse3 (and puts the patched one back if pip kept another).
scripts/build-pyfuse3.sh .venv/bin/python
if [ "$system" = 1 ]; then
  # rpmemfs on PATH and the mount(8) helper, so `mount -t fuse.rpmemfs` and fstab work; the
  # umount(8) helper, so `umount DIR` returns once the daemon has closed the pool. umount(8)
  # finds it as umount.fuse for an absolute DIR (its type from statfs(2) is just "fuse"); that
  # name passes other FUSE filesystems on to umount(8) itself, and is not taken from another.
  ln -sf "$PWD/.venv/bin/rpmemfs" /usr/local/bin/rpmemfs
  install -m 755 mount/mount.rpmemfs /sbin/mount.fuse.rpmemfs
  install -m 755 mount/umount.rpmemfs /sbin/umount.fuse.rpmemfs
  if [ ! -e /sbin/umount.fuse ] || grep -q "umount(8) helper (rpmemfs)" /sbin/umount.fuse; then
    install -m 755 mount/umount.rpmemfs /sbin/umount.fuse
  else
    echo "/sbin/umount.fuse is not ours: left alone; umount of an absolute path to an rpmemfs" \
         "mount will not wait for its daemon (rpmemfs umount does)" >&2
  fi
  # The units (docs/operations.md): rpmemfs@NAME mounts /etc/rpmemfs/NAME.conf's pool,
  # rpmemfs-target@NAME runs the target /etc/rpmemfs/target-NAME.conf describes.
  install -d -m 755 /etc/rpmemfs /etc/systemd/system
  install -m 644 mount/rpmemfs@.service mount/rpmemfs-target@.service /etc/systemd/system/
  if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
  # The Pacemaker resource agent ocf:rpmemfs:rpmemfs (docs/ha.md), where Pacemaker looks.
  install -d -m 755 /usr/lib/ocf/resource.d/rpmemfs
  install -m 755 mount/ocf/rpmemfs /usr/lib/ocf/resource.d/rpmemfs/rpmemfs
fi
.venv/bin/python -c "import rpmemfs.native as n; print('rpmemfs installed; cache flush:', n.flush_kind(), '; crc32c in hardware:', n.crc32c_hw())"
