#!/usr/bin/env bash
# Compare 4 KiB random write + fsync latency of GlusterFS (replica 2 over loopback) with rpmemfs
# (2 replicas, 0 replicas) and a plain tmpfs directory, all with the same fio job.
#
#   scripts/bench-glusterfs.sh [--keep]
#
#   --keep   keep the work directory (fio JSON, pools, daemon logs) afterwards
#
# Environment:
#   FIO_RUNTIME=20          seconds of measurement per target (the job is time based)
#   NUMJOBS=1               fio processes per target, each on a file of its own, reported
#                           together (issue 18 compares IOPS at 16)
#   BENCH_BASE=/dev/shm     where the work directory is made (tmpfs: everything in memory)
#   GLUSTER_HOST=127.0.0.2  loopback address used for the bricks and the mount (the gluster CLI
#                           refuses 127.0.0.1/localhost as a brick host; 127.0.0.2 is accepted)
#   RPMEMFS=.venv/bin/rpmemfs  the rpmemfs CLI to use
#   MOUNT_OPTS=pmem=force   the rpmemfs mount options (both rpmemfs targets)
#   TARGET_ARGS=            extra arguments for the two target daemons (e.g. "--spin-us 0")
#
# Installs glusterfs-server, glusterfs-client, fio and fuse3 with apt if they are missing. Needs
# root. Everything it starts (glusterd if it was not running, the volume, the mounts, the target
# daemons) is stopped again on exit, failure or Ctrl-C. See docs/glusterfs-comparison.md.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
KEEP=0
for arg in "$@"; do
    case $arg in
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "usage: $0 [--keep]" >&2; exit 2 ;;
    esac
done

FIO_RUNTIME=${FIO_RUNTIME:-20}
NUMJOBS=${NUMJOBS:-1}
BENCH_BASE=${BENCH_BASE:-/dev/shm}
GLUSTER_HOST=${GLUSTER_HOST:-127.0.0.2}
RPMEMFS=${RPMEMFS:-$REPO/.venv/bin/rpmemfs}
MOUNT_OPTS=${MOUNT_OPTS:-pmem=force}
TARGET_ARGS=${TARGET_ARGS:-}
VOL=rpmemfsbench
GLUSTERD_PIDFILE=/run/rpmemfs-bench-glusterd.pid   # glusterd started by this script
POOL_SIZE=512M

log() { printf '[bench-glusterfs] %s\n' "$*" >&2 2>/dev/null || true; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (glusterd, mount -t glusterfs and FUSE mounts need it)"
[ -x "$RPMEMFS" ] || die "$RPMEMFS not found: run scripts/install.sh first (or set RPMEMFS)"

# ---------------------------------------------------------------------------------------------
# Packages
need=()
command -v fio >/dev/null || need+=(fio)
command -v glusterd >/dev/null || need+=(glusterfs-server)
{ command -v mount.glusterfs >/dev/null || [ -x /sbin/mount.glusterfs ]; } || need+=(glusterfs-client)
command -v fusermount3 >/dev/null || need+=(fuse3)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    # glusterfs-server's postinst tries systemctl and complains when systemd is not PID 1; the
    # packages install fine regardless.
    apt-get install -y -q "${need[@]}" >&2
fi

# ---------------------------------------------------------------------------------------------
# State and cleanup (idempotent: every step checks what is still there)
WORK=""
LOCK=""
FIO_PID=""
STARTED_GLUSTERD=0
GLUSTERD_PID=""
VOL_CREATED=0
GMNT=""
RMNT_PIDS=()      # rpmemfs mount daemons (foreground, one per mount)
RMNTS=()          # their mount points
TARGET_PIDS=()    # rpmemfs target daemons

is_mounted() { awk -v m="$1" '$2 == m { f = 1 } END { exit !f }' /proc/mounts; }

alive() {  # PID: running and not a zombie
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "${st%% *}" != Z ]
}

wait_gone() {  # PID SECONDS
    local pid=$1 n=$(( $2 * 10 ))
    while alive "$pid" && [ "$n" -gt 0 ]; do sleep 0.1; n=$((n - 1)); done
    ! alive "$pid"
}

stop_pid() {  # SIGTERM, then SIGKILL after SECONDS
    local pid=$1 secs=${2:-10}
    [ -n "$pid" ] || return 0
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$pid" "$secs" || { kill -KILL "$pid" 2>/dev/null || true; wait_gone "$pid" 5 || true; }
}

stop_rpmemfs_mounts() {
    local i
    for i in "${!RMNT_PIDS[@]}"; do
        stop_pid "${RMNT_PIDS[$i]}" 60   # SIGTERM: the daemon unmounts and exits
        if is_mounted "${RMNTS[$i]}"; then
            fusermount3 -u -z "${RMNTS[$i]}" 2>/dev/null || umount -l "${RMNTS[$i]}" 2>/dev/null || true
        fi
    done
    RMNT_PIDS=(); RMNTS=()
}

stop_targets() {
    local pid
    for pid in "${TARGET_PIDS[@]}"; do stop_pid "$pid" 10; done
    TARGET_PIDS=()
}

gluster_volume_pids() {  # brick and self-heal daemon pids of $VOL
    cat /var/run/gluster/vols/"$VOL"/*.pid /var/run/gluster/shd/"$VOL"/*.pid 2>/dev/null || true
}

stop_gluster() {
    if [ -n "$GMNT" ] && is_mounted "$GMNT"; then
        umount "$GMNT" 2>/dev/null || umount -l "$GMNT" 2>/dev/null || true
    fi
    GMNT=""
    if [ "$VOL_CREATED" = 1 ]; then
        local pids
        pids=$(gluster_volume_pids)
        timeout 60 gluster --mode=script volume stop "$VOL" force >/dev/null 2>&1 || true
        timeout 60 gluster --mode=script volume delete "$VOL" >/dev/null 2>&1 || true
        for pid in $pids; do stop_pid "$pid" 5; done
        VOL_CREATED=0
    fi
    if [ "$STARTED_GLUSTERD" = 1 ]; then
        stop_pid "$GLUSTERD_PID" 10
        rm -f "$GLUSTERD_PIDFILE"
        STARTED_GLUSTERD=0
    fi
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    trap '' PIPE
    stop_pid "$FIO_PID" 10
    stop_rpmemfs_mounts
    stop_targets
    stop_gluster
    if [ -n "$LOCK" ] && [ "$(cat "$LOCK" 2>/dev/null)" = $$ ]; then rm -f "$LOCK"; fi
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        if [ "$KEEP" = 1 ]; then
            log "kept $WORK"
        elif awk -v w="$WORK/" 'index($2, w) == 1 { f = 1 } END { exit !f }' /proc/mounts; then
            log "something is still mounted under $WORK; not removing it"
        else
            rm -rf "$WORK"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
# A closed stderr (a pipe to `tee` that got the Ctrl-C too) must not stop the cleanup.
trap 'trap "" PIPE; log "interrupted"; exit 130' INT
trap 'trap "" PIPE; log "terminated"; exit 143' TERM

# One run at a time: the gluster volume name and glusterd are machine-wide. A pid file rather than
# flock: the daemons started here would inherit a lock descriptor and hold it after a SIGKILL.
LOCK=/run/rpmemfs-bench-glusterfs.pid
if ! (set -o noclobber; echo $$ > "$LOCK") 2>/dev/null; then
    other=$(cat "$LOCK" 2>/dev/null || true)
    if [ -n "$other" ] && [ "$other" != $$ ] && alive "$other" &&
       tr '\0' ' ' < "/proc/$other/cmdline" 2>/dev/null | grep -q bench-glusterfs; then
        LOCK=""
        die "another bench-glusterfs.sh is running (pid $other)"
    fi
    echo $$ > "$LOCK"   # left by a run that was killed
fi

# Leftovers of an earlier run that was killed (SIGKILL: no cleanup ran). The lock above means no
# other run owns them.
reap_stale() {
    local pid d m
    # Processes still working in earlier work directories: rpmemfs mount and target daemons, fio,
    # the glusterfs client and bricks (their command lines name the directory).
    for pid in $(pgrep -f -- "$BENCH_BASE/bench-glusterfs\\.[A-Za-z0-9]{6}/" || true); do
        [ "$pid" != $$ ] || continue
        log "stopping $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-100) (earlier run)"
        stop_pid "$pid" 30
    done
    awk -v b="$BENCH_BASE/bench-glusterfs." 'index($2, b) == 1 { print $2 }' /proc/mounts |
        sort -r | while read -r m; do
            log "unmounting $m (earlier run)"
            fusermount3 -u -z "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
        done
    for d in "$BENCH_BASE"/bench-glusterfs.??????; do
        [ -d "$d" ] && [ ! -e "$d/.keep" ] || continue
        awk -v w="$d/" 'index($2, w) == 1 { f = 1 } END { exit !f }' /proc/mounts && continue
        log "removing $d (earlier run)"
        rm -rf "$d"
    done
}
reap_stale

WORK=$(mktemp -d "$BENCH_BASE/bench-glusterfs.XXXXXX")
[ "$KEEP" = 0 ] || touch "$WORK/.keep"
log "work directory $WORK"

# ---------------------------------------------------------------------------------------------
# The fio job: the same for every target
FIO_ARGS=(--name=write4k_fsync --rw=randwrite --bs=4k --size=64m --fsync=1 --ioengine=psync
          --time_based --runtime="$FIO_RUNTIME" --output-format=json
          --numjobs="$NUMJOBS" --group_reporting)

run_fio() {  # NAME DIR
    local name=$1 dir=$2
    log "$name: fio ${FIO_ARGS[*]} in $dir"
    # In the background and waited for: fio catches SIGINT and exits normally, and bash then runs
    # no INT trap for a foreground child; `wait` is interrupted by the trap at once instead.
    # One job: the file fio.dat; several: a file each in the directory (fio names them).
    local where=(--filename="$dir/fio.dat")
    [ "$NUMJOBS" = 1 ] || where=(--directory="$dir" --size=$((64 / NUMJOBS > 4 ? 64 / NUMJOBS : 4))m)
    fio "${FIO_ARGS[@]}" "${where[@]}" --output="$WORK/$name.json" &
    FIO_PID=$!
    local rc=0
    wait "$FIO_PID" || rc=$?
    FIO_PID=""
    rm -f "$dir/fio.dat"
    return "$rc"
}

# ---------------------------------------------------------------------------------------------
# GlusterFS, replica 2, both bricks on this machine, FUSE client
GLUSTER_ERR=""
gluster_fail() { GLUSTER_ERR=$1; log "glusterfs: $1"; return 1; }

bench_gluster() {
    local out n
    # Leftovers of an earlier run that was killed: a mount of our volume, the volume itself.
    awk -v d="$GLUSTER_HOST:/$VOL" '$1 == d && $3 == "fuse.glusterfs" { print $2 }' /proc/mounts |
        while read -r m; do umount -l "$m" 2>/dev/null || true; done

    local old
    old=$(cat "$GLUSTERD_PIDFILE" 2>/dev/null || true)
    if [ -n "$old" ] && alive "$old" && [ "$(cat "/proc/$old/comm" 2>/dev/null)" = glusterd ]; then
        log "glusterd $old was started by an earlier run of this script; it is stopped at the end"
        STARTED_GLUSTERD=1
        GLUSTERD_PID=$old
    elif pgrep -x glusterd >/dev/null; then
        log "glusterd already running (not started by this script): using it, leaving it running"
    else
        rm -f "$GLUSTERD_PIDFILE"
        glusterd -p "$GLUSTERD_PIDFILE" || gluster_fail "glusterd did not start" || return 1
        STARTED_GLUSTERD=1
        n=0
        until [ -s "$GLUSTERD_PIDFILE" ]; do
            n=$((n + 1)); [ $n -lt 100 ] || { gluster_fail "glusterd wrote no pid file"; return 1; }
            sleep 0.1
        done
        GLUSTERD_PID=$(cat "$GLUSTERD_PIDFILE")
    fi
    n=0
    until gluster --mode=script pool list >/dev/null 2>&1; do
        n=$((n + 1)); [ $n -lt 60 ] || { gluster_fail "glusterd does not answer"; return 1; }
        sleep 0.5
    done
    if gluster --mode=script volume info "$VOL" >/dev/null 2>&1; then
        log "removing the volume $VOL left over by an earlier run"
        VOL_CREATED=1   # so that it is removed again even if the steps below fail
        timeout 60 gluster --mode=script volume stop "$VOL" force >/dev/null 2>&1 || true
        timeout 60 gluster --mode=script volume delete "$VOL" >/dev/null 2>&1 ||
            { gluster_fail "cannot delete the leftover volume $VOL"; return 1; }
        VOL_CREATED=0
    fi

    mkdir -p "$WORK/brick1" "$WORK/brick2" "$WORK/gmnt"
    # `force`: both bricks of the replica set are on one server, and on tmpfs.
    out=$(gluster --mode=script volume create "$VOL" replica 2 \
          "$GLUSTER_HOST:$WORK/brick1" "$GLUSTER_HOST:$WORK/brick2" force 2>&1) ||
        { gluster_fail "volume create: $out"; return 1; }
    VOL_CREATED=1
    out=$(gluster --mode=script volume start "$VOL" 2>&1) || { gluster_fail "volume start: $out"; return 1; }
    # Both bricks online (the XML status has one <node> per brick and per self-heal daemon).
    n=0
    until gluster --mode=script volume status "$VOL" --xml 2>/dev/null | python3 -c '
import sys, xml.etree.ElementTree as ET
nodes = ET.parse(sys.stdin).getroot().iter("node")
up = {n.findtext("path") for n in nodes if n.findtext("status") == "1"}
sys.exit(0 if {sys.argv[1] + "/brick1", sys.argv[1] + "/brick2"} <= up else 1)' "$WORK"; do
        n=$((n + 1)); [ $n -lt 60 ] || { gluster_fail "bricks did not come online"; return 1; }
        sleep 0.5
    done
    out=$(mount -t glusterfs "$GLUSTER_HOST:/$VOL" "$WORK/gmnt" 2>&1) ||
        { gluster_fail "mount -t glusterfs: $out"; return 1; }
    GMNT=$WORK/gmnt
    is_mounted "$GMNT" || { gluster_fail "$GMNT is not a mount after mount -t glusterfs"; return 1; }
    # The client must see both bricks before we measure: a probe file has to reach both.
    n=0
    until echo probe > "$GMNT/probe" && sync "$GMNT/probe" &&
          [ -s "$WORK/brick1/probe" ] && [ -s "$WORK/brick2/probe" ]; do
        n=$((n + 1)); [ $n -lt 60 ] || { gluster_fail "writes do not reach both bricks"; return 1; }
        sleep 0.5
    done
    rm -f "$GMNT/probe"

    run_fio glusterfs "$GMNT" || { gluster_fail "fio failed on the gluster mount"; return 1; }
    stop_gluster
}

# ---------------------------------------------------------------------------------------------
# rpmemfs
TARGET_ADDR=""
start_target() {  # DIR [extra args...]; sets TARGET_ADDR to its HOST:PORT
    local dir=$1; shift
    mkdir -p "$dir"
    : > "$dir.out"   # exists before the child's redirection runs, so sed below never fails
    # shellcheck disable=SC2086  # TARGET_ARGS is a list of words
    setsid "$RPMEMFS" target --listen 127.0.0.1:0 --pool-dir "$dir" --log-level warning "$@" $TARGET_ARGS \
        >"$dir.out" 2>"$dir.log" </dev/null &
    TARGET_PIDS+=($!)
    local n=0 addr=""
    while [ -z "$addr" ]; do
        addr=$(sed -n 's/^rpmemfs target listening on //p' "$dir.out" 2>/dev/null || true)
        [ -n "$addr" ] && break
        n=$((n + 1))
        if [ $n -ge 200 ] || ! alive "${TARGET_PIDS[-1]}"; then
            cat "$dir.log" >&2; die "target daemon for $dir did not start"
        fi
        sleep 0.1
    done
    TARGET_ADDR=$addr
}

mount_rpmemfs() {  # POOL MNT
    local pool=$1 mnt=$2 n=0
    mkdir -p "$mnt"
    setsid "$RPMEMFS" mount "$pool" "$mnt" -f -o "$MOUNT_OPTS" >"$pool.mount.log" 2>&1 </dev/null &
    RMNT_PIDS+=($!); RMNTS+=("$mnt")
    until is_mounted "$mnt"; do
        n=$((n + 1))
        if [ $n -ge 300 ] || ! alive "${RMNT_PIDS[-1]}"; then
            cat "$pool.mount.log" >&2; die "rpmemfs mount of $pool did not come up"
        fi
        sleep 0.1
    done
}

bench_rpmemfs_2rep() {
    local a1 a2
    start_target "$WORK/target1" --pmem force --persist apm; a1=$TARGET_ADDR
    start_target "$WORK/target2"; a2=$TARGET_ADDR
    log "rpmemfs targets: $a1 (apm, pmem=force), $a2 (gpspm)"
    "$RPMEMFS" mkfs "$WORK/rep2.pool" --size "$POOL_SIZE" --replica "$a1/a" --replica "$a2/b" >&2
    mount_rpmemfs "$WORK/rep2.pool" "$WORK/rmnt2"
    run_fio rpmemfs-2rep "$WORK/rmnt2" || die "fio failed on rpmemfs-2rep"
    # Check the replicas really took part.
    "$RPMEMFS" status "$WORK/rmnt2" --json > "$WORK/rpmemfs-2rep.status.json"
    python3 - "$WORK/rpmemfs-2rep.status.json" <<'EOF' || die "rpmemfs-2rep: replicas not in sync"
import json, sys
st = json.load(open(sys.argv[1]))
reps = st.get("replicas") or []
ok = len(reps) == 2 and all(r.get("state") == "in-sync" and r.get("barriers", 0) > 0 for r in reps)
for r in reps:
    print(f"[bench-glusterfs] replica {r.get('address')}/{r.get('name')}: {r.get('state')}, "
          f"method {r.get('method')}, {r.get('barriers')} barriers", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
    stop_rpmemfs_mounts
    stop_targets
}

bench_rpmemfs_0rep() {
    "$RPMEMFS" mkfs "$WORK/rep0.pool" --size "$POOL_SIZE" >&2
    mount_rpmemfs "$WORK/rep0.pool" "$WORK/rmnt0"
    run_fio rpmemfs-0rep "$WORK/rmnt0" || die "fio failed on rpmemfs-0rep"
    stop_rpmemfs_mounts
}

bench_plain() {
    mkdir -p "$WORK/plain"
    run_fio plain "$WORK/plain" || die "fio failed on the plain directory"
}

# ---------------------------------------------------------------------------------------------
log "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
GLUSTER_OK=1
bench_gluster || GLUSTER_OK=0
stop_gluster
bench_rpmemfs_2rep
bench_rpmemfs_0rep
bench_plain
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

echo
echo "fio: ${FIO_ARGS[*]}"
echo "$(glusterfs --version 2>/dev/null | head -1), $(fio --version), kernel $(uname -r)"
python3 - "$WORK" glusterfs rpmemfs-2rep rpmemfs-0rep plain <<'EOF'
import json, os, sys

work, names = sys.argv[1], sys.argv[2:]

def pct(lat, p):
    return lat.get("percentile", {}).get(p, float("nan")) / 1000.0  # ns -> us

rows = {}
for name in names:
    path = os.path.join(work, name + ".json")
    if not os.path.exists(path):
        rows[name] = None
        continue
    with open(path) as f:
        text = f.read()
    job = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print notes before the JSON
    w, s = job["write"], job["sync"]
    wp50, wp99 = pct(w["clat_ns"], "50.000000"), pct(w["clat_ns"], "99.000000")
    sp50, sp99 = pct(s["lat_ns"], "50.000000"), pct(s["lat_ns"], "99.000000")
    rows[name] = dict(w50=wp50, s50=sp50, p50=wp50 + sp50, p99=wp99 + sp99,
                      mean=1e6 / w["iops"] if w["iops"] else float("nan"), iops=w["iops"],
                      ios=w["total_ios"])

print()
print("latency of one 4 KiB write + its fsync, in microseconds: p50 = write clat p50 + fsync p50,")
print("p99 = write clat p99 + fsync p99, mean/op = 1/IOPS (wall time per write+fsync pair)")
hdr = f"{'target':<14}{'write p50':>10}{'fsync p50':>10}{'p50':>9}{'p99':>9}{'mean/op':>9}{'IOPS':>8}{'ios':>8}"
print(hdr)
print("-" * len(hdr))
for name in names:
    r = rows[name]
    if r is None:
        print(f"{name:<14}{'n/a':>10}")
        continue
    print(f"{name:<14}{r['w50']:>10.1f}{r['s50']:>10.1f}{r['p50']:>9.1f}{r['p99']:>9.1f}"
          f"{r['mean']:>9.1f}{r['iops']:>8.0f}{r['ios']:>8d}")
g, r2 = rows.get("glusterfs"), rows.get("rpmemfs-2rep")
print()
if g and r2:
    print(f"ratio glusterfs / rpmemfs-2rep: p50 {g['p50'] / r2['p50']:.2f}x, "
          f"p99 {g['p99'] / r2['p99']:.2f}x, mean/op {g['mean'] / r2['mean']:.2f}x")
else:
    print("ratio glusterfs / rpmemfs-2rep: n/a (glusterfs did not run)")
for name in names:
    r = rows[name]
    if r:
        print(f"RESULT {name} p50_us={r['p50']:.1f} p99_us={r['p99']:.1f} mean_us={r['mean']:.1f} "
              f"iops={r['iops']:.0f} write_p50_us={r['w50']:.1f} fsync_p50_us={r['s50']:.1f}")
EOF
if [ "$GLUSTER_OK" != 1 ]; then
    echo "glusterfs did not run: $GLUSTER_ERR"
    exit 1
fi
