#!/usr/bin/env bash
# Builds pyfuse3 from its sdist with patches/pyfuse3-$VERSION.patch applied (the operations
# libfuse has and pyfuse3 does not expose: fallocate, lseek, copy_file_range; the DONT_MASK
# capability; FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot negotiate, through a custom
# I/O hook; reading /dev/fuse before waiting on it; writes and fsyncs answered without a
# coroutine, or later by another task; docs/pyfuse3.md says what of it is proposed
# upstream), and installs it into the given Python's environment. Skips the build when that
# environment already has this exact patch (its hash is stamped beside pyfuse3), and when a
# wheel of it was built before on this machine (kept under ~/.cache/rpmemfs).
# With --wheel it only makes sure the wheel is there and prints its path: install.sh hands it
# to pip beside the package, so that pyfuse3 is not first built unpatched from its sdist.
# Usage: scripts/build-pyfuse3.sh PYTHON [--wheel]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh
PY=${1:?usage: build-pyfuse3.sh PYTHON [--wheel]}
only_wheel=0
[ "${2:-}" = --wheel ] && only_wheel=1
VERSION=3.5.0
PATCH="$PWD/patches/pyfuse3-$VERSION.patch"
want=$(sha256sum "$PATCH" | cut -c1-64)
have=$("$PY" -c 'import os, pyfuse3; p = os.path.join(os.path.dirname(pyfuse3.__file__), "rpmemfs-patch.sha256"); print(open(p).read().strip() if os.path.exists(p) else "")' 2>/dev/null || true)
if [ "$have" = "$want" ] && [ "$only_wheel" = 0 ]; then
  exit 0
fi
# A wheel fits another environment of the same interpreter and libfuse: the key says both.
abi=$("$PY" -c 'import sys, sysconfig; print(sys.implementation.cache_tag + "-" + sysconfig.get_platform())')
fuse=$(pkg-config --modversion fuse3 2>/dev/null || echo unknown)
cache="${XDG_CACHE_HOME:-${HOME:-$PWD}/.cache}/rpmemfs/pyfuse3-$VERSION-${want:0:16}-$abi-fuse$fuse"
wheel=$(ls "$cache"/pyfuse3-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # --no-binary for pyfuse3 alone: its build dependencies (Cython, setuptools) come as wheels.
  # (":all:" made pip build Cython itself from source first: five minutes on 2 cores.)
  step "downloading pyfuse3 $VERSION's source" \
    "$PY" -m pip download -q --no-deps --no-binary pyfuse3 --dest "$work" "pyfuse3==$VERSION"
  tar xzf "$work/pyfuse3-$VERSION.tar.gz" -C "$work"
  src="$work/pyfuse3-$VERSION"
  patch -s -p1 -d "$src" < "$PATCH"
  # The sdist carries Cython's output of the unpatched sources: drop it so the build cythonizes.
  rm -f "$src/src/pyfuse3/__init__.c"
  echo "install: pyfuse3 is built once per patch and machine: about 40 s on 2 cores" >&2
  step "building pyfuse3 $VERSION with patches/pyfuse3-$VERSION.patch" \
    "$PY" -m pip wheel -q --no-deps --wheel-dir "$work/wheel" "$src"
  mkdir -p "$cache"
  cp "$work"/wheel/pyfuse3-*.whl "$cache"/
  wheel=$(ls "$cache"/pyfuse3-*.whl | head -n 1)
fi
if [ "$only_wheel" = 1 ]; then
  echo "$wheel"
  exit 0
fi
step "installing the patched pyfuse3" "$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" - "$want" <<'PYEOF'
import os, sys
import pyfuse3
assert hasattr(pyfuse3.Operations, "lseek") and hasattr(pyfuse3, "handle_killpriv_v2"), "the patched pyfuse3 did not install"
with open(os.path.join(os.path.dirname(pyfuse3.__file__), "rpmemfs-patch.sha256"), "w") as f:
    f.write(sys.argv[1] + "\n")
PYEOF
