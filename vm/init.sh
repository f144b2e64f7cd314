#!/bin/busybox sh
# /init of the test VM's initramfs (busybox only). It builds the guest's root file system out
# of the host's and hands over to vm/guest.sh:
#   - the host's / (9p tag "hostroot", read-only) under an overlay whose upper layer is a
#     tmpfs, so the guest can write anywhere and nothing leaks back to the host;
#   - the job directory (tag "job") at /run/vm-job: the command, its environment, its status;
#   - the directories listed in /run/vm-job/rw (tags rw0, rw1, ...) read-write at their host
#     paths, so results written there land on the host.
# Whatever happens, it ends by printing VM-EXIT-STATUS=<n> and powering off.
/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

finish() {
    echo "VM-EXIT-STATUS=$1"
    sync
    poweroff -f
    # poweroff -f should not return; if it does, the sysrq trigger stops the machine.
    echo o > /proc/sysrq-trigger
}
fatal() {
    echo "vm init: $*"
    [ -d /newroot/run/vm-job ] && echo "vm init: $*" > /newroot/run/vm-job/failed
    finish 125
}

for m in $(cat /modules/order); do
    insmod "/modules/$m" || echo "vm init: insmod $m failed"
done

# Large 9p messages: fewer round trips through the (emulated) virtio queue.
NINEP="trans=virtio,version=9p2000.L,msize=512000"
mkdir -p /lower /upper /newroot
mount -t 9p -o "$NINEP,ro,cache=loose" hostroot /lower || fatal "cannot mount the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/data /upper/work
if ! mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot; then
    echo "vm init: overlayfs failed; read-only root with tmpfs on /tmp /var/tmp /root"
    mount --bind /lower /newroot
    for d in /tmp /var/tmp /root; do mount -t tmpfs tmpfs "/newroot$d"; done
fi

mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
mkdir -p /newroot/run/vm-job
mount -t 9p -o "$NINEP,cache=none" job /newroot/run/vm-job || fatal "cannot mount the job directory"

i=0
while IFS= read -r dir; do
    [ -n "$dir" ] || continue
    mkdir -p "/newroot$dir"
    # cache=mmap: writes reach the host at once and mmap works (pool files, pytest caches).
    mount -t 9p -o "$NINEP,cache=mmap" "rw$i" "/newroot$dir" || fatal "cannot mount $dir read-write"
    i=$((i + 1))
done < /newroot/run/vm-job/rw

read -r VM_DIR < /newroot/run/vm-job/vmdir
[ -f "/newroot$VM_DIR/guest.sh" ] || fatal "$VM_DIR/guest.sh is not visible in the guest"
chroot /newroot /bin/bash "$VM_DIR/guest.sh"
rc=$?
[ -f /newroot/run/vm-job/status ] && read -r rc < /newroot/run/vm-job/status
finish "$rc"
