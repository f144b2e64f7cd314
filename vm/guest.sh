#!/bin/bash
# Second stage inside the VM, run by /init (vm/init.sh) chrooted into the overlay of the
# host's root. It loads Soft-RoCE, builds the two-device network and runs the job's command
# with the caller's environment and working directory.
#
# Network ("pair"): veth0 10.77.0.1 with rxe0, veth1 10.77.0.2 with rxe1, both in the root
# namespace, because Linux 6.1's rdma_rxe only works in init_net (one rxe per network
# namespace does not pass traffic; see vm/README.md). Two local addresses would normally talk
# over lo; policy routing sends that traffic out of one veth end and in at the other, so rxe0
# and rxe1 really exchange RoCE v2 packets. The VM has no network card: none of this leaves it.
JOB=/run/vm-job
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
read -r VM_DIR < "$JOB/vmdir"
read -r KVER < /proc/sys/kernel/osrelease
DEBUG=0
[ -f "$JOB/debug" ] && read -r DEBUG < "$JOB/debug"
IP_A=10.77.0.1
IP_B=10.77.0.2

mark() {  # guest uptime at each step, for the timing line vm/run.sh prints
    local up _
    read -r up _ < /proc/uptime
    echo "$1 $up" >> "$JOB/marks"
}
fail() {
    echo "vm guest: $*"
    echo "$*" > "$JOB/failed"
    echo 125 > "$JOB/status"
    exit 125
}
# Under TCG every exec costs a few hundred ms: shell builtins and one "ip -batch" where we can.
sysctl_set() { echo "$2" > "/proc/sys/${1//.//}"; }

mark guest
[ "$DEBUG" = 1 ] && set -x
echo vm > /proc/sys/kernel/hostname

# The modules come from the unpacked Debian package on the host (vm/kernel/<version>).
mkdir -p "/lib/modules/$KVER"
mount --bind "$VM_DIR/kernel/$KVER/lib/modules/$KVER" "/lib/modules/$KVER" || fail "no modules for $KVER"
# rdma_rxe asks the crypto API for crc32; the kernel's own module loader would run the
# initramfs's modprobe, which knows no modules, so load it here.
modprobe -a crc32_generic veth rdma_rxe ib_uverbs rdma_ucm || fail "modprobe failed"
# FUSE for the end-to-end mount (built in on some kernels, a module on Debian's), and a
# /dev/shm for the pools the tests keep there.
modprobe fuse 2>/dev/null || true
mkdir -p /dev/shm && mount -t tmpfs -o mode=1777 tmpfs /dev/shm || fail "cannot mount /dev/shm"

ip -batch - <<EOF || fail "network setup failed"
link set lo up
link add veth0 type veth peer name veth1
addr add $IP_A/24 dev veth0
addr add $IP_B/24 dev veth1
link set veth0 up
link set veth1 up
route add $IP_B/32 dev veth0 src $IP_A table 100
route add $IP_A/32 dev veth1 src $IP_B table 101
rule add pref 100 iif lo from $IP_A to $IP_A lookup local
rule add pref 101 iif lo from $IP_B to $IP_B lookup local
rule add pref 102 iif lo from $IP_A to $IP_B lookup 100
rule add pref 103 iif lo from $IP_B to $IP_A lookup 101
rule add pref 104 iif lo to $IP_B lookup 100
rule add pref 105 iif lo to $IP_A lookup 101
rule add pref 200 lookup local
rule del pref 0
EOF
# Packets from a local source address arriving on veth: accept them (accept_local) and do not
# drop them as spoofed (rp_filter).
for dev in all default veth0 veth1; do
    sysctl_set "net.ipv4.conf.$dev.accept_local" 1
    sysctl_set "net.ipv4.conf.$dev.rp_filter" 0
done
rdma link add rxe0 type rxe netdev veth0 || fail "cannot create rxe0"
rdma link add rxe1 type rxe netdev veth1 || fail "cannot create rxe1"

# rdmacm needs the IPv4-mapped GID of each device; the kernel fills it in shortly after.
gid_of() { printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${1//./ }; }
has_gid() { grep -qsx "$(gid_of "$2")" /sys/class/infiniband/"$1"/ports/1/gids/{0..3}; }
for _ in {1..100}; do
    has_gid rxe0 $IP_A && has_gid rxe1 $IP_B && break
    sleep 0.1
done
has_gid rxe0 $IP_A && has_gid rxe1 $IP_B || fail "rxe0/rxe1 have no IPv4 GID"
mark ready

# An emulated NVDIMM (vm/run.sh VM_NVDIMM=MiB, VM_NVDIMM_MODE): fsdax with ext4 -o dax on it,
# device DAX namespaces, or both in its one region.
pmem_dir=
dax_devs=
if [ -e "$JOB/nvdimm" ]; then
    read -r nv_mib nv_mode < "$JOB/nvdimm"
    # device_dax binds the devdax namespaces to /dev/daxX.Y; the kernel would load it through
    # the initramfs's modprobe, which knows no modules.
    modprobe -a nfit nd_pmem dax_pmem device_dax 2>/dev/null || modprobe -a nfit nd_pmem || fail "cannot load the NVDIMM drivers"
    for _ in {1..100}; do [ -e /sys/bus/nd/devices/namespace0.0 ] && break; sleep 0.1; done
    # The NVDIMM's namespace starts raw, where ext4 cannot use DAX (no struct pages for it) and
    # no device DAX can be made: give it labels, then carve namespaces with their page maps in
    # RAM (the NVDIMM is small). Sizes are whole units of the region's alignment (16 MiB under
    # QEMU: "align setting is 0x1000000"); one unit stays unused for the labels.
    units=$((nv_mib / 16 - 1))
    case "${nv_mode:-fsdax}" in
        fsdax) fs_mib=$((units * 16)) dax_mib=0 ;;
        devdax) fs_mib=0 dax_mib=$((units / 2 * 16)) ;;
        both) fs_mib=$((units / 2 * 16)) dax_mib=$(((units - units / 2) / 2 * 16)) ;;
    esac
    {
        ndctl disable-region all && ndctl init-labels -f all && ndctl enable-region all &&
        if [ "$fs_mib" -gt 0 ]; then ndctl create-namespace -m fsdax -M mem -a 2M -s "${fs_mib}M"; fi &&
        if [ "$dax_mib" -gt 0 ]; then
            # Two, so that a primary and a target (or two pools) each have one.
            ndctl create-namespace -m devdax -M mem -a 2M -s "${dax_mib}M" &&
            ndctl create-namespace -m devdax -M mem -a 2M -s "${dax_mib}M"
        fi
    } > "$JOB/ndctl.log" 2>&1 || { cat "$JOB/ndctl.log"; fail "ndctl cannot lay out the NVDIMM as $nv_mode"; }
    if [ "$fs_mib" -gt 0 ]; then
        for _ in {1..100}; do [ -b /dev/pmem0 ] && break; sleep 0.1; done
        [ -b /dev/pmem0 ] || fail "no /dev/pmem0 from the emulated NVDIMM"
        modprobe ext4 || fail "cannot load ext4"
        mkfs.ext4 -q -F -b 4096 /dev/pmem0 || fail "mkfs.ext4 on /dev/pmem0 failed"
        mkdir -p /mnt/pmem
        mount -o dax /dev/pmem0 /mnt/pmem || { dmesg | tail -5; fail "cannot mount /dev/pmem0 with -o dax"; }
        pmem_dir=/mnt/pmem
    fi
    if [ "$dax_mib" -gt 0 ]; then
        for _ in {1..100}; do
            set -- /dev/dax*.*
            [ -c "$1" ] && [ $# -ge 2 ] && break
            sleep 0.1
        done
        [ -c "$1" ] && [ $# -ge 2 ] || { cat "$JOB/ndctl.log"; fail "no /dev/daxX.Y from the devdax namespaces"; }
        dax_devs=$(IFS=,; echo "$*")
        set --
    fi
    mark pmem
fi

# The caller's environment, then ours on top.
# shellcheck disable=SC1091
source "$JOB/env"
export RXE_VM=1 RXE_DEV_A=rxe0 RXE_DEV_B=rxe1 RXE_IP_A=$IP_A RXE_IP_B=$IP_B
[ -n "$pmem_dir" ] && export RPMEMFS_PMEM_DIR=$pmem_dir
[ -n "$dax_devs" ] && export RPMEMFS_DAX_DEVS=$dax_devs
ulimit -l unlimited   # registered memory is locked memory
read -r cwd < "$JOB/cwd"
cd "$cwd" || fail "no directory $cwd in the guest"
set +x
touch "$JOB/started"
bash "$JOB/cmd" < /dev/null
rc=$?
mark done
echo "$rc" > "$JOB/status"
sync
exit "$rc"
