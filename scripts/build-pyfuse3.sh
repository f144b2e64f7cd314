#!/usr/bin/env bash
# Builds pyfuse3 from its sdist with patches/pyfuse3-$VERSION.patch applied (the operations
# libfuse has and pyfuse3 does not expose: fallocate, lseek, copy_file_range; the DONT_MASK
# capability; FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14 cannot negotiate, through a custom
# I/O hook; reading /dev/fuse before waiting on it), and installs it into the given Python's
# environment. Skips the build when that environment already has this exact patch (its hash
# is stamped beside pyfuse3).
# Usage: scripts/build-pyfuse3.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: build-pyfuse3.sh PYTHON}
VERSION=3.5.0
PATCH="$PWD/patches/pyfuse3-$VERSION.patch"
want=$(sha256sum "$PATCH" | cut -c1-64)
have=$("$PY" -c 'import os, pyfuse3; p = os.path.join(os.path.dirname(pyfuse3.__file__), "rpmemfs-patch.sha256"); print(open(p).read().strip() if os.path.exists(p) else "")' 2>/dev/null || true)
if [ "$have" = "$want" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building pyfuse3 $VERSION with patches/pyfuse3-$VERSION.patch" >&2
"$PY" -m pip download -q --no-deps --no-binary :all: --dest "$work" "pyfuse3==$VERSION"
tar xzf "$work/pyfuse3-$VERSION.tar.gz" -C "$work"
src="$work/pyfuse3-$VERSION"
patch -s -p1 -d "$src" < "$PATCH"
# The sdist carries Cython's output of the unpatched sources: drop it so the build cythonizes.
rm -f "$src/src/pyfuse3/__init__.c"
"$PY" -m pip install -q --no-deps --force-reinstall "$src"
"$PY" - "$want" <<'PYEOF'
import os, sys
import pyfuse3
assert hasattr(pyfuse3.Operations, "lseek") and hasattr(pyfuse3, "handle_killpriv_v2"), "the patched pyfuse3 did not install"
with open(os.path.join(os.path.dirname(pyfuse3.__file__), "rpmemfs-patch.sha256"), "w") as f:
    f.write(sys.argv[1] + "\n")
PYEOF
