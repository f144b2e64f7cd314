#!/usr/bin/env bash
# Runs a command inside a throw-away QEMU VM that has real Soft-RoCE (rdma_rxe) devices, the
# host's root file system (read-only, with a tmpfs overlay) and this repository read-write.
#
#   vm/run.sh CMD ARG...        run CMD with its arguments (quoted for you)
#   vm/run.sh 'SHELL LINE'      a single argument is a shell command line
#
# The command runs as root in the caller's working directory with the caller's exported
# environment, plus RXE_VM=1, RXE_DEV_A=rxe0, RXE_DEV_B=rxe1, RXE_IP_A=10.77.0.1 and
# RXE_IP_B=10.77.0.2 (rxe0 on veth0, rxe1 on veth1). Its output is the VM's console.
#
# Exit status: the command's; 125 when the VM could not start (or died under the command),
# 124 when VM_TIMEOUT passed.
#
# Knobs: VM_TIMEOUT=1800 (s, whole run)     VM_BOOT_TIMEOUT=120 (s until the command starts)
#        VM_BOOT_RETRIES=2                  VM_MEM=2048 (MiB)   VM_SMP=$(nproc)
#        VM_KERNEL=<version under vm/kernel> VM_ACCEL=auto|tcg|kvm
#        VM_RW=dir1:dir2 (more read-write directories)   VM_DEBUG=1 (kernel log, set -x)
#        VM_NVDIMM=MiB (an emulated NVDIMM of that size, backed by a sparse file of the job) and
#        VM_NVDIMM_MODE, what the guest makes of it:
#          fsdax (default)  /dev/pmem0 with ext4 mounted -o dax at /mnt/pmem;
#                           exports RPMEMFS_PMEM_DIR=/mnt/pmem
#          devdax           two device DAX namespaces (2 MiB alignment); exports their
#                           devices, RPMEMFS_DAX_DEVS=/dev/dax0.0,/dev/dax0.1
#          both             half fsdax, two quarters devdax; exports both variables
set -uo pipefail
VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$VM_DIR")

if [ $# -eq 0 ]; then
    sed -n '2,22p' "${BASH_SOURCE[0]}" >&2
    exit 2
fi
say() { echo "vm/run.sh: $*" >&2; }
cannot_start() { say "the VM could not start: $*"; exit 125; }

kver=${VM_KERNEL:-$(cat "$VM_DIR/kernel/default" 2>/dev/null)}
kdir=$VM_DIR/kernel/$kver
[ -n "$kver" ] && [ -f "$kdir/initramfs.cpio.gz" ] || cannot_start "no kernel prepared; run vm/setup.sh"
command -v qemu-system-x86_64 >/dev/null || cannot_start "qemu-system-x86_64 is missing; run vm/setup.sh"
kimage=$kdir/vmlinux
[ -f "$kimage" ] || kimage=$kdir/boot/vmlinuz-$kver

TIMEOUT=${VM_TIMEOUT:-1800}
BOOT_TIMEOUT=${VM_BOOT_TIMEOUT:-120}
RETRIES=${VM_BOOT_RETRIES:-2}
DEBUG=${VM_DEBUG:-0}
accel=${VM_ACCEL:-auto}
if [ "$accel" = auto ]; then
    # A /dev/kvm without vmx/svm (this machine's is a software one) fails on real guests.
    accel=tcg
    if [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then accel=kvm; fi
fi
if [ "$accel" = kvm ]; then cpu=(-accel kvm -cpu host); else cpu=(-accel tcg,thread=multi -cpu max); fi

JOB=$(mktemp -d "${TMPDIR:-/tmp}/rpmemfs-vm.XXXXXX")
qpid=
tpid=
cleanup() {
    [ -n "$qpid" ] && kill "$qpid" 2>/dev/null
    [ -n "$tpid" ] && wait "$tpid" 2>/dev/null
    rm -rf "$JOB"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the job: command, environment, directories ----------------------------------------------
if [ $# -eq 1 ]; then
    printf '%s\n' "$1" > "$JOB/cmd"
else
    printf '%q ' "$@" > "$JOB/cmd"
    echo >> "$JOB/cmd"
fi
export -p | grep -vE '^declare -[a-z]*x[a-z]* (BASH[A-Z_]*|PWD|OLDPWD|SHLVL|_|HOSTNAME|TERM|VM_[A-Z_]*)(=|$)' > "$JOB/env"
pwd -P > "$JOB/cwd"
echo "$VM_DIR" > "$JOB/vmdir"
echo "$DEBUG" > "$JOB/debug"

qesc() { printf '%s' "${1//,/,,}"; }   # a comma inside a QEMU option value is written twice
shares=(-fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap"
        -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot
        -fsdev "local,id=job,path=$(qesc "$JOB"),security_model=none"
        -device virtio-9p-pci,fsdev=job,mount_tag=job)
: > "$JOB/rw"
n=0
IFS=: read -r -a extra <<< "${VM_RW:-}"
for d in "$REPO" "${extra[@]}"; do
    [ -n "$d" ] || continue
    d=$(cd "$d" 2>/dev/null && pwd -P) || cannot_start "no such directory: $d"
    [ "$d" != / ] && ! grep -qxF "$d" "$JOB/rw" || continue
    echo "$d" >> "$JOB/rw"
    shares+=(-fsdev "local,id=rw$n,path=$(qesc "$d"),security_model=none,multidevs=remap"
             -device "virtio-9p-pci,fsdev=rw$n,mount_tag=rw$n")
    n=$((n + 1))
done

# An NVDIMM (QEMU's nvdimm device, ACPI NFIT) backed by a file: the guest's libnvdimm turns it
# into /dev/pmem0, on which ext4 with -o dax gives real MAP_SYNC mappings.
mem=${VM_MEM:-2048}
machine=()
memory=(-m "$mem")
if [ -n "${VM_NVDIMM:-}" ]; then
    [[ $VM_NVDIMM =~ ^[0-9]+$ ]] && ((VM_NVDIMM >= 64)) || cannot_start "VM_NVDIMM must be a size in MiB, at least 64"
    case "${VM_NVDIMM_MODE:=fsdax}" in
        fsdax|devdax|both) ;;
        *) cannot_start "VM_NVDIMM_MODE must be fsdax, devdax or both, not $VM_NVDIMM_MODE" ;;
    esac
    truncate -s "${VM_NVDIMM}M" "$JOB/nvdimm.img" || cannot_start "cannot make the NVDIMM's backing file"
    echo "$VM_NVDIMM $VM_NVDIMM_MODE" > "$JOB/nvdimm"
    machine=(-machine pc,nvdimm=on)
    memory=(-m "$mem,slots=2,maxmem=$((mem + VM_NVDIMM))M"
            -object "memory-backend-file,id=nv0,share=on,mem-path=$(qesc "$JOB/nvdimm.img"),size=${VM_NVDIMM}M"
            -device nvdimm,id=nvdimm0,memdev=nv0,label-size=128K)
fi
if [ "$DEBUG" = 1 ]; then klog="loglevel=7"; else klog="quiet loglevel=3"; fi
# mitigations=off: the guest's Spectre/Meltdown defences only cost time under emulation.
qemu=(qemu-system-x86_64 "${cpu[@]}" "${machine[@]}" "${memory[@]}" -smp "${VM_SMP:-$(nproc)}"
      -nodefaults -no-user-config -display none -no-reboot
      -kernel "$kimage" -initrd "$kdir/initramfs.cpio.gz"
      -append "console=ttyS0 panic=-1 mitigations=off $klog"
      -serial "file:$JOB/console" -device virtio-rng-pci "${shares[@]}")

# --- boot, with a watchdog ---------------------------------------------------------------------
now() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }   # milliseconds
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }
start=$(now)
attempt=0
while :; do
    attempt=$((attempt + 1))
    rm -f "$JOB"/{console,marks,started,failed,status}
    t0=$(now)
    "${qemu[@]}" < /dev/null > "$JOB/qemu.out" 2>&1 &
    qpid=$!
    # Show the console as it comes; tail ends by itself once QEMU has exited.
    tail -s 0.2 -n +1 -F --pid="$qpid" "$JOB/console" 2>/dev/null \
        | sed -u -e 's/\r$//' -e '/reboot: Power down/d' -e '/^VM-EXIT-STATUS=/d' &
    tpid=$!
    hung=0 timed_out=0 ready_ms=
    while kill -0 "$qpid" 2>/dev/null; do
        sleep 0.2
        if [ -z "$ready_ms" ] && [ -e "$JOB/started" ]; then ready_ms=$(($(now) - t0)); fi
        if [ -z "$ready_ms" ] && [ ! -e "$JOB/failed" ] && (($(now) - t0 > BOOT_TIMEOUT * 1000)); then
            hung=1
            kill "$qpid"
        elif (($(now) - start > TIMEOUT * 1000)); then
            timed_out=1
            kill "$qpid"
        fi
    done
    wait "$qpid"
    qrc=$?
    qpid=
    wait "$tpid"
    tpid=
    if ((hung)); then
        mkdir -p "$VM_DIR/logs"
        log=$VM_DIR/logs/boot-hang-$(date +%Y%m%d-%H%M%S).log
        cp "$JOB/console" "$log" 2>/dev/null
        say "the guest did not start the command within ${BOOT_TIMEOUT}s (console: $log)"
        if ((attempt <= RETRIES)); then
            say "booting again (attempt $((attempt + 1)))"
            continue
        fi
        cannot_start "no boot in $attempt attempts"
    fi
    break
done
mkdir -p "$VM_DIR/logs"
cp "$JOB/console" "$VM_DIR/logs/last-console.log" 2>/dev/null

total_ms=$(($(now) - start))
if [ -n "$ready_ms" ]; then
    up=$(awk '$1 == "ready" {print $2}' "$JOB/marks" 2>/dev/null)
    say "kernel $kver ($accel): command started $(secs "$ready_ms") s after boot (guest uptime ${up:-?} s), total $(secs "$total_ms") s"
fi
if ((timed_out)); then
    say "timed out after ${TIMEOUT}s"
    exit 124
fi
[ -e "$JOB/failed" ] && cannot_start "$(cat "$JOB/failed")"
if [ -z "$ready_ms" ]; then
    [ -s "$JOB/qemu.out" ] && cat "$JOB/qemu.out" >&2
    cannot_start "QEMU exited with status $qrc before the command started"
fi
if [ -s "$JOB/status" ]; then
    exit "$(cat "$JOB/status")"
fi
say "the VM died while the command ran (no exit status; console: vm/logs/last-console.log)"
exit 125
