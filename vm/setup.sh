#!/usr/bin/env bash
# Prepares everything vm/run.sh needs, from the Debian archive only. Safe to run again: each
# step is skipped when its result is already there.
#
#   1. apt-get install QEMU, a static busybox, kmod, iproute2 and the RDMA user space.
#   2. apt-get download the Debian kernel package (never installed: the host keeps its own
#      kernel), unpack it under vm/kernel/<version>/ and index its modules with depmod.
#   3. Pull the uncompressed vmlinux out of the bzImage (QEMU boots it directly, skipping the
#      in-guest decompression, which is slow under TCG).
#   4. Build the initramfs: busybox, vm/init.sh as /init, and the few modules needed to mount
#      the host's root over virtio-9p with an overlay.
#
# Knobs: VM_KERNEL_PKG=linux-image-...   the kernel package (default: the one that
#                                        linux-image-amd64 depends on)
#        VM_NO_APT=1                     skip step 1 (packages already there)
set -euo pipefail
VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$VM_DIR"
say() { echo "vm/setup.sh: $*" >&2; }
die() { say "$*"; exit 1; }

PACKAGES=(qemu-system-x86 busybox-static cpio kmod iproute2 python3 rdma-core ibverbs-providers
          ibverbs-utils rdmacm-utils perftest python3-pyverbs zstd ndctl e2fsprogs
          libssl-dev)  # the native helper links libcrypto (wire protection, native/rpmem_sec.c)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

if [ "${VM_NO_APT:-0}" != 1 ]; then
    missing=()
    for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
    if ((${#missing[@]})); then
        say "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

# --- 2. the kernel ---------------------------------------------------------------------------
pkg=${VM_KERNEL_PKG:-}
if [ -z "$pkg" ]; then
    # The metapackage names the current ABI, e.g. linux-image-6.1.0-56-amd64.
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ {print $2; exit}')
    if [ -z "$pkg" ]; then
        apt-get update -qq
        pkg=$(apt-cache depends linux-image-amd64 | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ {print $2; exit}')
    fi
fi
[ -n "$pkg" ] || die "cannot tell which kernel package linux-image-amd64 depends on"
kver=${pkg#linux-image-}
kdir=kernel/$kver

if [ ! -f "$kdir/boot/vmlinuz-$kver" ]; then
    mkdir -p debs
    if ! ls debs/"${pkg}"_*.deb >/dev/null 2>&1; then
        say "downloading $pkg"
        (cd debs && apt-get download -q "$pkg" 2>&1 | grep -v 'unsandboxed as root' >&2) || true
    fi
    deb=$(ls -t debs/"${pkg}"_*.deb 2>/dev/null | head -1)
    [ -n "$deb" ] || die "apt-get download $pkg failed"
    say "unpacking $deb"
    rm -rf "$kdir.tmp"
    mkdir -p "$(dirname "$kdir")"
    dpkg-deb -x "$deb" "$kdir.tmp"
    rm -rf "$kdir"
    mv "$kdir.tmp" "$kdir"
fi
mods=$kdir/lib/modules/$kver
[ -d "$mods" ] || die "$mods is missing from $pkg"
[ -f "$mods/modules.dep" ] || depmod -b "$VM_DIR/$kdir" "$kver"
for m in rdma_rxe ib_uverbs rdma_ucm veth 9p 9pnet_virtio overlay; do
    modprobe -d "$VM_DIR/$kdir" -S "$kver" --show-depends "$m" >/dev/null 2>&1 \
        || die "$pkg has no module $m"
done

# --- 3. vmlinux --------------------------------------------------------------------------------
# QEMU can boot an ELF vmlinux through its PVH entry point; that saves the real-mode setup and
# the xz decompression (about 4 s under TCG). run.sh falls back to the bzImage without it.
if [ ! -f "$kdir/vmlinux" ] && grep -q '^CONFIG_PVH=y' "$kdir/boot/config-$kver"; then
    /usr/bin/python3 - "$kdir/boot/vmlinuz-$kver" "$kdir/vmlinux" <<'PY' || say "no vmlinux: will boot the bzImage"
import lzma
import struct
import subprocess
import sys

image = open(sys.argv[1], "rb").read()
# x86 boot protocol: the setup code is (setup_sects + 1) sectors; payload_offset/length in the
# setup header locate the compressed kernel inside the protected-mode part.
setup_sects = image[0x1F1] or 4
payload_offset, payload_length = struct.unpack_from("<II", image, 0x248)
start = (setup_sects + 1) * 512 + payload_offset
payload = image[start : start + payload_length]
if payload.startswith(b"\xfd7zXZ\x00"):  # Debian's 6.1
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
elif payload.startswith(b"\x28\xb5\x2f\xfd"):  # zstd (Debian's 6.12); the kernel appends
    # the uncompressed size as 4 bytes, which the zstd tool would take for a broken frame.
    elf = subprocess.run(["zstd", "-qdc"], input=payload[:-4], stdout=subprocess.PIPE,
                         check=True).stdout
else:
    sys.exit("the kernel payload is neither xz- nor zstd-compressed")
if not elf.startswith(b"\x7fELF"):
    sys.exit("the kernel payload is not an ELF file")
with open(sys.argv[2] + ".tmp", "wb") as out:
    out.write(elf)
PY
    [ -f "$kdir/vmlinux.tmp" ] && mv "$kdir/vmlinux.tmp" "$kdir/vmlinux"
fi

# --- 4. initramfs ------------------------------------------------------------------------------
# Only what it takes to reach the host's root: the rest (rdma_rxe and friends) is loaded later
# with modprobe, straight from $kdir over 9p.
initrd=$kdir/initramfs.cpio.gz
if [ ! -f "$initrd" ] || [ init.sh -nt "$initrd" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/bin" "$tmp/modules"
    cp /bin/busybox "$tmp/bin/busybox"
    # A dynamically linked busybox would find no libc in the initramfs (ldd fails on static ones).
    if ldd /bin/busybox >/dev/null 2>&1; then die "/bin/busybox is not static (is busybox-static installed?)"; fi
    install -m 0755 init.sh "$tmp/init"
    for m in virtio_pci virtio_rng 9pnet_virtio 9p overlay; do
        modprobe -d "$VM_DIR/$kdir" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
    done | awk '!seen[$0]++' | while read -r ko; do
        name=$(basename "$ko")
        # busybox insmod wants plain .ko files; newer Debian kernels ship them xz-compressed.
        case "$name" in
            *.ko.xz) xz -dc "$ko" > "$tmp/modules/${name%.xz}"; name=${name%.xz} ;;
            *.ko.zst) zstd -qdc "$ko" > "$tmp/modules/${name%.zst}"; name=${name%.zst} ;;
            *) cp "$ko" "$tmp/modules/$name" ;;
        esac
        echo "$name" >> "$tmp/modules/order"   # dependencies come first
    done
    (cd "$tmp" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
    mv "$initrd.tmp" "$initrd"
fi

mkdir -p logs
echo "$kver" > kernel/default
say "ready: kernel $kver ($(du -sh "$kdir" | cut -f1) unpacked), initramfs $(du -h "$initrd" | cut -f1)"
