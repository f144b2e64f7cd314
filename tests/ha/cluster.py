"""A real Pacemaker/Corosync cluster on one machine, for tests.

Each node is a network + mount + UTS namespace. Real corosync (knet) and pacemakerd run
in it, with real fencing by `fence_netns` (kills everything in the victim's netns). A port
of the shell prototype in /work/notes/ha-proto (see its FINDINGS.md for the measurements
and the reasons behind the design).

Topology::

    netns <bridge>:  br0 + veth v1..vN, and the "anchor" process (sleep)
    netns <node>:    eth0 <subnet>.<i>/24 (peer of v<i>), lo

Each node has a *holder* (`sleep infinity`, started as
`ip netns exec <node> unshare --mount --uts --propagation private`) that keeps its mount
and UTS namespaces alive. The harness mounts into that mount namespace: tmpfs on /run and
/dev/shm, binds from `<base>/nodes/<node>/` onto /etc/corosync, /var/lib/pacemaker, the
log directories, the fence agent overlaid onto /usr/sbin and the caller's binds/overlays.
Daemons and commands join the holder with `nsenter -t <holder> -n -m -u`: pacemaker's IPC
uses abstract unix sockets, which are per netns, and libqb's rings in the private /dev/shm.

The anchor exists because the fence agent runs inside a node (private /run, so no
/run/netns) and `nsenter -t 1` is refused in the sandbox: the anchor's mount namespace is
a slave of the root one and still sees /run/netns.

Liveness is `ip netns pids`, never `kill -0`: a kill -9'd daemon may stay an unreaped
zombie for a while, and a zombie answers kill -0 but has no namespaces.

Usage (tests/ha/smoke.py is a complete example)::

    with Cluster("/tmp/ha", overlays=[(ra_dir, "/usr/lib/ocf/resource.d/rpmemfs")],
                 extra_binds=[("/srv/pools/{node}", "/var/lib/rpmemfs")]) as c:
        c.up(resources_xml)
        p = c.wait(lambda: c.promoted_on("n1", "st-clone"), 60, "a promoted instance")
        writer = c.popen(p, ["my-writer", "/mnt/x"], netns=False)  # survives kill_node(p)
        c.kill_node(p)
        q = c.wait(lambda: c.promoted_on(c.nodes[0] if p != c.nodes[0] else c.nodes[1],
                                         "st-clone"), 30, "a new promoted node")
        c.start_node(p)
        c.wait_online()
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
FENCE_AGENT = HERE / "fence_netns"
PACKAGES = ("pacemaker", "pacemaker-cli-utils", "corosync")
CLUSTER_TOOLS = ("corosync", "corosync-cfgtool", "pacemakerd", "crm_mon", "crm_verify", "cibadmin")
SYSTEM_TOOLS = ("ip", "nsenter", "unshare", "mount", "umount", "hostname", "timeout")
NETNS_DIR = Path("/run/netns")
# Node-private tmpfs in every node: a missing mount point below them is simply created.
PRIVATE_TMPFS = {"/run": "mode=755,size=64m", "/dev/shm": "mode=1777,size=256m"}
# Environment of pacemakerd (and so of the resource agents), before Cluster(env=...).
BASE_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    # /etc/default/pacemaker is not read without systemd: pass its settings directly.
    "PCMK_logfile": "/var/log/pacemaker/pacemaker.log",
    "PCMK_logfacility": "none",
    "PCMK_blackbox": "no",
}
# (directory under <base>/nodes/<node>, path in the node, owner hacluster?, mode)
STATE_BINDS: tuple[tuple[str, str, bool, int], ...] = (
    ("etc-corosync", "/etc/corosync", False, 0o755),
    ("var-lib-corosync", "/var/lib/corosync", False, 0o755),
    ("var-lib-pacemaker", "/var/lib/pacemaker", True, 0o750),
    ("log-pacemaker", "/var/log/pacemaker", True, 0o770),
    ("log-corosync", "/var/log/corosync", False, 0o755),
    ("log-cluster", "/var/log/cluster", False, 0o755),
)
# Safe in mount options (overlayfs lowerdir splits on ':' and ','), shell and config files.
SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/+@-]*$")
NODE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,14}$")

T = TypeVar("T")
PathLike = str | os.PathLike[str]
Mounts = Sequence[tuple[PathLike, str]]


class ClusterError(RuntimeError):
    """The cluster or a command in it did not do what was asked."""


class ClusterTimeout(ClusterError):
    """`Cluster.wait` gave up."""


@dataclass
class _Node:
    name: str
    index: int  # 1-based: corosync nodeid, address <subnet>.<index>, veth v<index>
    dir: Path
    holder: int | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class _UserMount:
    source: str  # host path ({node} expanded)
    target: str  # path in the node (symlinks resolved on the host)
    overlay: bool  # True: read-only overlay (or read-only bind where target is missing)


class Cluster:
    """A Pacemaker/Corosync cluster of namespaced nodes on this machine (root needed).

    `base` (on disk, not under /run or /dev/shm, which are private in the nodes) holds
    everything: `nodes/<node>/` (config, CIB, logs: log-pacemaker/pacemaker.log,
    log-corosync/corosync.log, corosync.out, pacemakerd.out), `fence.log`, `cib-seed.xml`.
    It is wiped by `up()` and kept after `down()` for post-mortems.

    `extra_binds`: read-write bind mounts made in every node, `(host_path, path_in_node)`
    with "{node}" in either expanded; or a mapping node -> such a list.
    `overlays`: `(host_dir, dir_in_node)`: where dir_in_node exists, a read-only overlayfs
    `lowerdir=host_dir:dir_in_node` (host_dir's entries win); where it does not, host_dir
    bind-mounted read-only there. A missing mount point (for both) is made by overlaying
    its nearest existing ancestor, read-only, with a directory holding the missing entries
    (e.g. /usr/lib/ocf/resource.d for /usr/lib/ocf/resource.d/rpmemfs), or is simply
    created below /run and /dev/shm. Host paths are taken before the node's /run and
    /dev/shm are replaced, so they may lie there (e.g. a /dev/shm scratch dir).
    `env`: added to pacemakerd's environment, which the resource agents inherit.
    """

    def __init__(
        self,
        base: PathLike,
        nodes: Sequence[str] = ("n1", "n2", "n3"),
        *,
        subnet: str = "10.77.0",
        bridge_netns: str = "habr",
        token_ms: int = 1000,
        token_coefficient_ms: int = 0,
        fencing: bool = True,
        extra_binds: Mounts | Mapping[str, Mounts] = (),
        overlays: Mounts = (),
        env: Mapping[str, str] | None = None,
        cluster_name: str = "rpmemfs-ha",
    ) -> None:
        self.base = Path(os.path.realpath(base))
        self.nodes: tuple[str, ...] = tuple(nodes)
        self.subnet = subnet
        self.bridge_netns = bridge_netns
        self.token_ms = token_ms
        self.token_coefficient_ms = token_coefficient_ms
        self.fencing = fencing
        self.cluster_name = cluster_name
        self.env = dict(env or {})
        if not SAFE_PATH.match(str(self.base)):
            raise ValueError(f"base {self.base}: use only [A-Za-z0-9._/+@-]")
        if any(str(self.base) == p or str(self.base).startswith(p + "/") for p in PRIVATE_TMPFS):
            raise ValueError(f"base {self.base} is under a directory that is private in the nodes")
        if not self.nodes or len(set(self.nodes)) != len(self.nodes) or len(self.nodes) > 250:
            raise ValueError(f"nodes {self.nodes!r}: 1..250 distinct names")
        for name in (*self.nodes, bridge_netns):
            if not NODE_NAME.match(name):
                raise ValueError(f"name {name!r}: want {NODE_NAME.pattern}")
        if bridge_netns in self.nodes:
            raise ValueError("bridge_netns must differ from the node names")
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet):
            raise ValueError(f"subnet {subnet!r}: want the first three octets, like 10.77.0")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", cluster_name):
            raise ValueError(f"cluster_name {cluster_name!r}")
        self._nodes = {
            n: _Node(n, i, self.base / "nodes" / n) for i, n in enumerate(self.nodes, start=1)
        }
        self._extra_binds = extra_binds
        self._overlays = overlays
        self._user_mounts: dict[str, list[_UserMount]] = {}
        self._anchor: subprocess.Popen[bytes] | None = None
        self._user_procs: list[subprocess.Popen[Any]] = []
        # Our netns and the mount ns of every holder we started: "net:[inode]" -> an open
        # fd, which keeps the namespace (and so its inode number) from being recycled
        # until down() has killed whatever is left in it.
        self._ns_fds: dict[str, int] = {}
        self._netns_made: list[str] = []  # names we added, in order
        self._generation = 0
        self._started = False
        self._netns_dir_state = _netns_dir_state()
        self._old_sigterm: Any = None

    # ----------------------------------------------------------------- context manager

    def __enter__(self) -> Cluster:
        # SIGTERM (e.g. `timeout`, a CI runner) would end the process without unwinding:
        # make it an exception so that __exit__ tears down.
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.down()
        except ClusterError as e:
            if exc is None:
                raise
            print(f"cluster teardown: {e}", file=sys.stderr)
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    # ----------------------------------------------------------------- bring-up

    def up(
        self,
        resources_xml: str,
        constraints_xml: str = "",
        properties: Mapping[str, str] | None = None,
        timeout: float = 90.0,
    ) -> None:
        """Start the whole cluster with this configuration; return once every node sees
        every node online in a partition with quorum. Tears down again if it fails.

        `resources_xml` / `constraints_xml`: CIB fragments (any number of elements) for
        <resources> / <constraints>; `properties`: cluster properties, overriding ours
        (dc-deadtime=3s, no-quorum-policy=stop, stonith-enabled, stonith-action=off, ...).
        The fence device (when fencing) is the primitive "fence-netns"."""
        if self._started:
            raise ClusterError("up() twice: call down() first")
        for name in (*self.nodes, self.bridge_netns):
            if (NETNS_DIR / name).exists():
                raise ClusterError(
                    f"netns {name} exists already (another cluster, or a stale one, which "
                    f"Cluster({str(self.base)!r}, <same names>).down(force=True) removes)"
                )
        self._user_mounts = {n: self._plan_user_mounts(n) for n in self.nodes}
        self._netns_dir_state = _netns_dir_state()
        self._started = True
        try:
            self._check_tools()
            self._prepare_base()
            seed = self._write_cib(resources_xml, constraints_xml, properties or {})
            self._write_corosync_conf()
            if self.fencing:
                self._write_fence_agent()
            self._make_network()
            for n in self.nodes:
                self._start(n, seed)
            self.wait_online(timeout=timeout)
        except BaseException:
            self.down()
            raise

    def _check_tools(self) -> None:
        missing = [t for t in SYSTEM_TOOLS if shutil.which(t) is None]
        if missing:
            raise ClusterError(f"missing tools: {' '.join(missing)}")
        if all(shutil.which(t) for t in CLUSTER_TOOLS):
            return
        apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        self._sh(["apt-get", "update", "-qq"], timeout=300, env=apt_env)
        self._sh(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
            timeout=900,
            env=apt_env,
        )
        missing = [t for t in CLUSTER_TOOLS if shutil.which(t) is None]
        if missing:
            raise ClusterError(f"still missing after installing {PACKAGES}: {missing}")

    def _prepare_base(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for sub in ("nodes", "sbin"):
            shutil.rmtree(self.base / sub, ignore_errors=True)
        for f in ("anchor.pid", "fence.log", "fence_netns.conf", "cib-seed.xml", "authkey"):
            (self.base / f).unlink(missing_ok=True)
        (self.base / "fence.log").touch()
        key = os.urandom(256)
        for node in self._nodes.values():
            etc = node.dir / "etc-corosync"
            (etc / "uidgid.d").mkdir(parents=True)
            (etc / "authkey").write_bytes(key)
            (etc / "authkey").chmod(0o400)

    def _write_cib(self, resources_xml: str, constraints_xml: str, properties: Mapping[str, str]) -> Path:
        props = {
            "cluster-name": self.cluster_name,
            "dc-deadtime": "3s",  # the first DC election waits 20 s otherwise
            "no-quorum-policy": "stop",
            "cluster-recheck-interval": "1min",
        }
        if self.fencing:
            props |= {"stonith-enabled": "true", "stonith-action": "off", "stonith-timeout": "20s"}
        else:
            props["stonith-enabled"] = "false"
        props |= {k: str(v) for k, v in properties.items()}
        cib = ET.Element(
            "cib", {"validate-with": "pacemaker-3.9", "epoch": "1", "num_updates": "0", "admin_epoch": "0"}
        )
        conf = ET.SubElement(cib, "configuration")
        cps = ET.SubElement(
            ET.SubElement(conf, "crm_config"), "cluster_property_set", id="cib-bootstrap-options"
        )
        for k, v in props.items():
            ET.SubElement(cps, "nvpair", id=f"cib-bootstrap-options-{k}", name=k, value=v)
        ET.SubElement(conf, "nodes")
        resources = ET.SubElement(conf, "resources")
        if self.fencing:
            fence = ET.SubElement(resources, "primitive", id="fence-netns", type="fence_netns")
            fence.set("class", "stonith")
            ia = ET.SubElement(fence, "instance_attributes", id="fence-netns-ia")
            hosts = " ".join(self.nodes)
            ET.SubElement(ia, "nvpair", id="fence-netns-hl", name="pcmk_host_list", value=hosts)
            ops = ET.SubElement(fence, "operations")
            ET.SubElement(ops, "op", id="fence-netns-mon", name="monitor", interval="60s")
        resources.extend(_fragment("resources", resources_xml))
        ET.SubElement(conf, "constraints").extend(_fragment("constraints", constraints_xml))
        meta = ET.SubElement(ET.SubElement(conf, "rsc_defaults"), "meta_attributes", id="rsc-options")
        ET.SubElement(meta, "nvpair", id="rsc-options-stickiness", name="resource-stickiness", value="1")
        ET.SubElement(cib, "status")
        ET.indent(cib)
        seed = self.base / "cib-seed.xml"
        seed.write_text(ET.tostring(cib, encoding="unicode") + "\n")
        r = self._sh(["crm_verify", "--xml-file", str(seed)], check=False)
        if r.returncode != 0:
            raise ClusterError(f"the CIB ({seed}) does not verify:\n{r.stdout}{r.stderr}")
        return seed

    def _write_corosync_conf(self) -> None:
        nodelist = "".join(
            f"    node {{\n        ring0_addr: {self.address(n.name)}\n"
            f"        name: {n.name}\n        nodeid: {n.index}\n    }}\n"
            for n in self._nodes.values()
        )
        conf = f"""totem {{
    version: 2
    cluster_name: {self.cluster_name}
    transport: knet
    crypto_cipher: aes256
    crypto_hash: sha256
    token: {self.token_ms}
    token_coefficient: {self.token_coefficient_ms}
}}
nodelist {{
{nodelist}}}
quorum {{
    provider: corosync_votequorum
}}
logging {{
    to_logfile: yes
    logfile: /var/log/corosync/corosync.log
    to_syslog: no
    to_stderr: no
    timestamp: on
}}
"""
        for node in self._nodes.values():
            (node.dir / "etc-corosync" / "corosync.conf").write_text(conf)

    def _write_fence_agent(self) -> None:
        conf = self.base / "fence_netns.conf"
        settings = {
            "HA_ANCHOR_PIDFILE": str(self.base / "anchor.pid"),
            "HA_NODES": " ".join(self.nodes),
            "HA_BRNS": self.bridge_netns,
            "HA_VETHS": " ".join(f"{n.name}={self._veth(n.name)}" for n in self._nodes.values()),
            "HA_FENCE_LOG": str(self.base / "fence.log"),
        }
        conf.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in settings.items()))
        text = FENCE_AGENT.read_text()
        if "@HA_CONF@" not in text:
            raise ClusterError(f"{FENCE_AGENT}: no @HA_CONF@ placeholder")
        sbin = self.base / "sbin"
        sbin.mkdir()
        agent = sbin / "fence_netns"
        agent.write_text(text.replace("@HA_CONF@", str(conf)))
        agent.chmod(0o755)

    def _make_network(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        self._sh(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        self._sh(["ip", "-n", br, "link", "set", "br0", "up"])
        self._sh(["ip", "-n", br, "link", "set", "lo", "up"])
        # The fence agent's way to /run/netns (see the module docstring).
        self._anchor = self._spawn_host(
            ["ip", "netns", "exec", br, "sleep", "infinity"], self.base / "anchor.out"
        )
        _wait_exec(self._anchor, "sleep", self.base / "anchor.out")
        (self.base / "anchor.pid").write_text(f"{self._anchor.pid}\n")
        for node in self._nodes.values():
            n, v = node.name, self._veth(node.name)
            self._add_netns(n)
            self._sh(["ip", "-n", br, "link", "add", v, "type", "veth", "peer", "name", "eth0", "netns", n])
            self._sh(["ip", "-n", br, "link", "set", v, "master", "br0", "up"])
            self._sh(["ip", "-n", n, "addr", "add", f"{self.address(n)}/24", "dev", "eth0"])
            self._sh(["ip", "-n", n, "link", "set", "eth0", "up"])
            self._sh(["ip", "-n", n, "link", "set", "lo", "up"])

    # ----------------------------------------------------------------- nodes

    def start_node(self, n: str, timeout: float = 30.0) -> None:
        """(Re)start a killed or fenced node, then return (see `wait_online`).

        First waits (up to `timeout` in all) until nothing runs in its netns, and until
        every other running node that has quorum sees `n` offline and not unclean, i.e.
        has noticed the loss and (with fencing) fenced it: restarted earlier, the new
        incarnation would be the one fenced. Then sets its link up and starts holder,
        corosync and pacemakerd. It gets an empty /var/lib/pacemaker and syncs the CIB
        from the DC, unless no other node runs: then it starts from the seed CIB."""
        self._node(n)
        if not self._started:
            raise ClusterError("start_node() before up()")
        deadline = time.monotonic() + timeout
        self.wait(lambda: not self.alive(n), timeout, f"{n}'s netns to be empty (kill_node({n!r}) first?)")

        def loss_handled() -> bool:
            for m in self.nodes:
                if m == n or not self.alive(m):
                    continue
                state = self.node_states(m)
                if state and self.quorate(m):
                    mine = state.get(n, {})
                    if mine.get("online") == "true" or mine.get("unclean") == "true":
                        return False
            return True

        what = f"the other nodes to see {n} offline" + (" and fenced" if self.fencing else "")
        self.wait(loss_handled, max(0.0, deadline - time.monotonic()), what, interval=0.1)
        others_alive = any(self.alive(m) for m in self.nodes if m != n)
        try:
            self._start(n, None if others_alive else self.base / "cib-seed.xml")
        except BaseException:
            with contextlib.suppress(ClusterError):
                self.kill_node(n)
            raise

    def _start(self, n: str, seed: Path | None) -> None:
        node = self._node(n)
        self._reap()
        if self.alive(n):
            raise ClusterError(f"{n} still has processes: {self._netns_pids(n)}")
        self._release_dead_mount_ns()
        node.procs = [p for p in node.procs if p.poll() is None]
        node.holder = None
        d = node.dir
        hacluster = pwd.getpwnam("hacluster").pw_uid
        haclient = grp.getgrnam("haclient").gr_gid
        # Volatile state is fresh at each start; logs and config stay.
        # (mount points and overlay layers live in a new directory per start: an older
        # mount ns may still use the previous ones, see popen(netns=False))
        for sub in ("var-lib-pacemaker", "var-lib-corosync"):
            shutil.rmtree(d / sub, ignore_errors=True)
        self._generation += 1
        for sub, _target, ha, mode in STATE_BINDS:
            (d / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(d / sub, mode)
            if ha:
                os.chown(d / sub, hacluster, haclient)
        for sub in ("cib", "pengine", "blackbox", "cores"):
            p = d / "var-lib-pacemaker" / sub
            p.mkdir(mode=0o750)
            os.chown(p, hacluster, haclient)
        if seed is not None:
            cib = d / "var-lib-pacemaker" / "cib" / "cib.xml"
            shutil.copyfile(seed, cib)
            os.chmod(cib, 0o600)
            os.chown(cib, hacluster, haclient)
        self._sh(["ip", "-n", n, "link", "set", "lo", "up"])
        self._sh(["ip", "-n", self.bridge_netns, "link", "set", self._veth(n), "up"])

        log = d / "holder.out"
        holder = self._spawn_host(
            ["ip", "netns", "exec", n, "unshare", "--mount", "--uts", "--propagation", "private",
             "sleep", "infinity"],
            log,
        )
        node.procs.append(holder)
        _wait_exec(holder, "sleep", log)
        node.holder = holder.pid
        (d / "holder.pid").write_text(f"{holder.pid}\n")
        self._hold_ns(f"/proc/{holder.pid}/ns/mnt")
        self._setup_mounts(node)

        corosync = self._spawn_in(n, ["/usr/sbin/corosync", "-f"], d / "corosync.out")
        node.procs.append(corosync)

        def corosync_answers() -> bool:
            if corosync.poll() is not None:
                raise ClusterError(
                    f"corosync on {n} exited with {corosync.returncode}:\n{self.log_tail(n)}"
                )
            return self.run(n, ["corosync-cfgtool", "-s"], timeout=5, check=False).returncode == 0

        self.wait(corosync_answers, 15, f"corosync on {n} to answer", interval=0.1)
        env = {**BASE_ENV, **self.env}
        node.procs.append(self._spawn_in(n, ["/usr/sbin/pacemakerd"], d / "pacemakerd.out", env=env))

    def _setup_mounts(self, node: _Node) -> None:
        """Mount what the node needs into its holder's (private) mount namespace."""
        n, h, d = node.name, node.holder, node.dir
        assert h is not None
        root = Path(f"/proc/{h}/root")  # the node's view of the file system

        def nsx(*argv: str) -> None:
            self._sh(["nsenter", "-t", str(h), "-m", "-u", "--", *argv])

        nsx("hostname", n)
        # 1. Take hold of the caller's host paths while the host's /run and /dev/shm are
        #    still visible here.
        user = self._user_mounts[n]
        grabs: list[Path] = []
        for k, m in enumerate(user):
            g = d / f"mnt{self._generation}" / "grab" / str(k)
            g.parent.mkdir(parents=True, exist_ok=True)
            if os.path.isdir(m.source):
                g.mkdir()
            else:
                g.touch()
            nsx("mount", "--bind", m.source, str(g))
            grabs.append(g)
        # 2. Private volatile dirs.
        for path, opts in PRIVATE_TMPFS.items():
            nsx("mount", "-t", "tmpfs", "-o", opts, "tmpfs", path)
        for sub in ("run/crm", "run/resource-agents", "run/lock"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chown(root / "run/crm", pwd.getpwnam("hacluster").pw_uid, grp.getgrnam("haclient").gr_gid)
        # 3. Mount points: which exist now (decides overlay vs read-only bind), then make
        #    the missing ones.
        targets: list[tuple[str, bool]] = [(t, True) for _s, t, _h, _m in STATE_BINDS]
        if self.fencing:
            targets.append(("/usr/sbin", True))
        targets += [(m.target, os.path.isdir(m.source)) for m in user]
        existed = {t for t, _ in targets if (root / t.lstrip("/")).exists()}
        self._make_mountpoints(node, [(t, is_dir) for t, is_dir in targets if t not in existed])
        # 4. The mounts.
        for sub, target, _h, _m in STATE_BINDS:
            nsx("mount", "--bind", str(d / sub), target)
        if self.fencing:
            sbin = self.base / "sbin"
            nsx("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={sbin}:/usr/sbin", "/usr/sbin")
        for m, g in zip(user, grabs, strict=True):
            if not m.overlay:
                nsx("mount", "--bind", str(g), m.target)
            elif m.target in existed:
                nsx("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={g}:{m.target}", m.target)
            else:
                nsx("mount", "--bind", str(g), m.target)
                nsx("mount", "-o", "remount,bind,ro", m.target)

    def _make_mountpoints(self, node: _Node, missing: Iterable[tuple[str, bool]]) -> None:
        """Create missing mount points in the node without writing to the host: below the
        node's tmpfs directly, elsewhere by overlaying (read-only) the nearest existing
        ancestor with a directory that holds the missing entries."""
        assert node.holder is not None
        h = node.holder
        root = Path(f"/proc/{h}/root")
        groups: dict[str, list[tuple[str, bool]]] = {}
        for target, is_dir in missing:
            if any(target.startswith(p + "/") for p in PRIVATE_TMPFS):
                _make_entry(root / target.lstrip("/"), is_dir)
                continue
            anc = os.path.dirname(target)
            while not (root / anc.lstrip("/")).is_dir():
                anc = os.path.dirname(anc)
            if anc == "/":
                raise ClusterError(f"{node.name}: cannot make mount point {target}: only / exists above it")
            groups.setdefault(anc, []).append((os.path.relpath(target, anc), is_dir))
        for k, anc in enumerate(sorted(groups, key=lambda a: a.count("/"))):
            below = [mp for mp in _mount_points(h) if mp.startswith(anc + "/")]
            if below or str(self.base).startswith(anc + "/"):
                raise ClusterError(
                    f"{node.name}: making the mount point(s) {groups[anc]} in {anc} means "
                    f"overlaying {anc} read-only, which would hide or freeze "
                    f"{below or self.base}: pick a target whose nearest existing ancestor "
                    "holds neither mounts nor the base dir, or create it on the host"
                )
            stage = node.dir / f"mnt{self._generation}" / "stage" / str(k)
            for rel, is_dir in groups[anc]:
                _make_entry(stage / rel, is_dir)
            # The merged directory takes its owner and mode from the top layer.
            st = (root / anc.lstrip("/")).stat()
            os.chown(stage, st.st_uid, st.st_gid)
            os.chmod(stage, st.st_mode & 0o7777)
            self._sh(
                ["nsenter", "-t", str(h), "-m", "--", "mount", "-t", "overlay", "overlay",
                 "-o", f"lowerdir={stage}:{anc}", anc]
            )

    def kill_node(self, n: str, timeout: float = 10.0) -> None:
        """Crash node `n`: kill -9 every process in its netns (repeatedly, until none is
        left), then set its link down. Processes started with popen(netns=False) live on."""
        self._node(n)
        _, survivors = _kill_all(lambda: self._netns_pids(n), timeout, 0.02)
        if survivors:
            raise ClusterError(f"{n}: processes survive kill -9: {survivors}")
        self.partition(n)
        self._reap()

    def partition(self, n: str) -> None:
        """Cut node `n`'s link (its processes keep running)."""
        self._sh(["ip", "-n", self.bridge_netns, "link", "set", self._veth(n), "down"])

    def heal(self, n: str) -> None:
        """Set node `n`'s link up again."""
        self._sh(["ip", "-n", self.bridge_netns, "link", "set", self._veth(n), "up"])

    def alive(self, n: str) -> bool:
        """Whether anything runs in node `n`'s netns (zombies do not count)."""
        return bool(self._netns_pids(n))

    def holder_pid(self, n: str) -> int:
        """The pid that holds node `n`'s namespaces; ClusterError if the node is down."""
        node = self._node(n)
        h = node.holder
        if h is None:
            raise ClusterError(f"{n} is not running")
        try:  # a zombie or a reused pid has no (or another) netns
            alive = os.readlink(f"/proc/{h}/ns/net") == _netns_id(n)
        except OSError:
            alive = False
        if not alive:
            raise ClusterError(f"{n} is not running (its holder {h} is gone)")
        return h

    def address(self, n: str) -> str:
        return f"{self.subnet}.{self._node(n).index}"

    def node_dir(self, n: str) -> Path:
        return self._node(n).dir

    # ----------------------------------------------------------------- commands

    def _nsenter(self, n: str, netns: bool = True) -> list[str]:
        return ["nsenter", "-t", str(self.holder_pid(n)), *(["-n"] if netns else []), "-m", "-u", "--"]

    def run(
        self,
        n: str,
        argv: Sequence[str],
        timeout: float = 30.0,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside node `n` (its netns, mount and UTS ns) and capture its output."""
        cmd = [*self._nsenter(n), *argv]
        r = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and r.returncode != 0:
            raise ClusterError(
                f"{n}: {shlex.join(argv)} -> exit {r.returncode}\n{r.stdout}{r.stderr}".rstrip()
            )
        return r

    def popen(self, n: str, argv: Sequence[str], netns: bool = True, **kw: Any) -> subprocess.Popen[Any]:
        """Start `argv` in node `n`'s namespaces. With netns=False it joins only the mount
        and UTS namespaces: it sees the node's mounts (e.g. a FUSE mount made there) but is
        not in the node's netns, so kill_node() and fencing leave it alive. down() kills it
        (its process group: start_new_session defaults to True), and anything else still
        in a namespace of the cluster. Extra keywords go to subprocess.Popen."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p: subprocess.Popen[Any] = subprocess.Popen([*self._nsenter(n, netns), *argv], **kw)
        self._user_procs.append(p)
        return p

    # ----------------------------------------------------------------- observation

    def crm_mon_xml(self, n: str, timeout: float = 10.0) -> ET.Element:
        """`crm_mon -1 --output-as=xml` as node `n` sees the cluster. ClusterError if it
        fails (crm_mon then prints a <pacemaker-result> with an error status, no state)."""
        r = self.run(n, ["crm_mon", "-1", "--output-as=xml"], timeout=timeout, check=False)
        with contextlib.suppress(ET.ParseError):
            mon = ET.fromstring(r.stdout)
            status = mon.find("status")
            ok = status is not None and status.get("code") == "0" and mon.find("summary") is not None
            if r.returncode == 0 and ok:
                return mon
        raise ClusterError(f"{n}: crm_mon -> exit {r.returncode}\n{r.stdout}{r.stderr}".rstrip())

    def _mon(self, n: str) -> ET.Element | None:
        try:
            return self.crm_mon_xml(n)
        except (ClusterError, subprocess.TimeoutExpired):
            return None

    def node_states(self, observer: str) -> dict[str, dict[str, str]]:
        """node -> its attributes in `observer`'s crm_mon XML (online, unclean, pending,
        standby, is_dc, ...: "true"/"false"); empty if `observer` cannot tell."""
        mon = self._mon(observer)
        if mon is None:
            return {}
        return {e.get("name", ""): dict(e.attrib) for e in mon.iterfind("nodes/node")}

    def online(self, observer: str) -> set[str]:
        """The nodes that `observer` sees online (empty if it cannot tell)."""
        return {n for n, a in self.node_states(observer).items() if a.get("online") == "true"}

    def quorate(self, n: str) -> bool | None:
        """Whether node `n` is in a partition with a DC and quorum; None (falsy too) if it
        cannot tell (not running, crm_mon failing)."""
        mon = self._mon(n)
        if mon is None:
            return None
        dc = mon.find("summary/current_dc")
        return dc is not None and dc.get("present") == "true" and dc.get("with_quorum") == "true"

    def roles(self, observer: str, rsc_id: str) -> dict[str, str] | None:
        """node -> role ("Started", "Promoted", "Unpromoted", "Starting", ...) of the active,
        not failed instances of resource or clone `rsc_id`, as `observer` sees them; None
        if `observer` cannot tell (not running, crm_mon failing), so that "not in roles"
        reliably means stopped."""
        mon = self._mon(observer)
        if mon is None:
            return None
        found: dict[str, str] = {}
        for top in mon.iterfind("resources/*"):
            if top.get("id") != rsc_id:
                continue
            for r in top.iter("resource"):
                if r.get("active") != "true" or r.get("failed") == "true":
                    continue
                role = {"Master": "Promoted", "Slave": "Unpromoted"}.get(r.get("role", ""), r.get("role", ""))
                for node in r.iterfind("node"):
                    found[node.get("name", "")] = role
        return found

    def promoted_nodes(self, observer: str, clone_id: str) -> set[str]:
        """Where `observer` sees `clone_id` promoted (empty if it cannot tell)."""
        return {n for n, role in (self.roles(observer, clone_id) or {}).items() if role == "Promoted"}

    def promoted_on(self, observer: str, clone_id: str) -> str | None:
        """The node where `clone_id` is promoted as `observer` sees it, or None. With more
        than one (promoted-max > 1, or a split brain) it raises: use promoted_nodes."""
        p = self.promoted_nodes(observer, clone_id)
        if len(p) > 1:
            raise ClusterError(f"{observer} sees {clone_id} promoted on {sorted(p)}")
        return next(iter(p), None)

    def wait(
        self, predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25
    ) -> T:
        """Poll `predicate` until it returns something truthy, and return that. Raises
        ClusterTimeout naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise ClusterTimeout(
                    f"timed out after {timeout:g} s waiting for {what} (last: {value!r}; "
                    f"logs under {self.base}/nodes, see Cluster.log_tail)"
                )
            self._reap()
            time.sleep(interval)

    def wait_online(self, nodes: Iterable[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until each of `nodes` (default: all) sees all of them online, with quorum."""
        want = set(self.nodes if nodes is None else nodes)

        def formed() -> bool:
            return all(want <= self.online(n) and self.quorate(n) for n in sorted(want))

        self.wait(formed, timeout, f"{sorted(want)} online with quorum")

    def log_tail(self, n: str, lines: int = 40) -> str:
        """The ends of node `n`'s pacemaker, corosync and daemon logs."""
        d = self._node(n).dir
        out = []
        for f in ("log-pacemaker/pacemaker.log", "log-corosync/corosync.log", "corosync.out",
                  "pacemakerd.out", "holder.out"):
            p = d / f
            if p.exists():
                tail = p.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"==> {p} <==\n" + "\n".join(tail))
        return "\n".join(out)

    def fence_log(self) -> str:
        """What the fence agent logged (one line per call; "off n1 -> rc=0" when done)."""
        p = self.base / "fence.log"
        return p.read_text() if p.exists() else ""

    # ----------------------------------------------------------------- teardown

    def down(self, force: bool = False) -> None:
        """Kill everything the cluster started, delete its namespaces, put /run/netns back
        as it was. Idempotent. force=True also removes namespaces with our names that this
        object did not make (a stale cluster left by a killed test run). SIGINT/SIGTERM
        wait until it is done. ClusterError if something survives."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._teardown(force)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _teardown(self, force: bool) -> None:
        problems: list[str] = []
        killed: set[int] = set()
        for p in self._user_procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
        names = [*self.nodes, self.bridge_netns] if force else list(self._netns_made)
        for name in names:
            if not (NETNS_DIR / name).exists():
                continue
            with contextlib.suppress(OSError):
                self._hold_ns(str(NETNS_DIR / name))
            gone, survivors = _kill_all(functools.partial(self._netns_pids, name), 10, 0.02)
            killed.update(gone)
            if survivors:
                problems.append(f"netns {name}: survivors {survivors}")
            r = self._sh(["ip", "netns", "del", name], check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {name}: {r.stderr.strip()}")
        # Whatever is still in one of our namespaces (e.g. in a node's mount ns but not its
        # netns, or in a netns that was deleted already).
        gone, left = _kill_all(self._ns_members, 10, 0.05)
        killed.update(gone)
        if left:
            problems.append(f"processes left in the cluster's namespaces: {left}")
        procs = [*self._user_procs, *(p for n in self._nodes.values() for p in n.procs)]
        if self._anchor is not None:
            procs.append(self._anchor)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        # The others' zombies are reaped by PID 1 (or a subreaper), which may take a moment.
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        for node in self._nodes.values():
            node.procs.clear()
            node.holder = None
            (node.dir / "holder.pid").unlink(missing_ok=True)
        self._user_procs.clear()
        self._anchor = None
        (self.base / "anchor.pid").unlink(missing_ok=True)
        self._started = False
        made_any = bool(self._netns_made)
        self._netns_made.clear()
        if not problems:  # else keep them: the ids of what is left must stay unique
            for fd in self._ns_fds.values():
                os.close(fd)
            self._ns_fds.clear()
        if made_any or force:
            problems += _restore_netns_dir(self._netns_dir_state)
        if problems:
            raise ClusterError("teardown incomplete: " + "; ".join(problems))

    # ----------------------------------------------------------------- internals

    def _node(self, n: str) -> _Node:
        try:
            return self._nodes[n]
        except KeyError:
            raise ValueError(f"no node {n!r} (nodes: {self.nodes})") from None

    def _veth(self, n: str) -> str:
        return f"v{self._node(n).index}"

    def _plan_user_mounts(self, n: str) -> list[_UserMount]:
        eb = self._extra_binds
        binds = eb.get(n, ()) if isinstance(eb, Mapping) else eb
        out: list[_UserMount] = []
        for entries, overlay in ((self._overlays, True), (binds, False)):
            for src, dst in entries:
                s = os.path.realpath(str(src).replace("{node}", n))
                t = os.path.realpath(str(dst).replace("{node}", n))
                for p in (s, t):
                    if not SAFE_PATH.match(p) or p == "/":
                        raise ValueError(f"{n}: mount path {p!r}: use only [A-Za-z0-9._/+@-], not /")
                if not os.path.exists(s):
                    raise ValueError(f"{n}: {s} does not exist")
                if overlay and not os.path.isdir(s):
                    raise ValueError(f"{n}: overlay source {s} is not a directory")
                out.append(_UserMount(s, t, overlay))
        return out

    def _add_netns(self, name: str) -> None:
        self._sh(["ip", "netns", "add", name])
        self._netns_made.append(name)
        self._hold_ns(str(NETNS_DIR / name))

    def _hold_ns(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        kind = "net" if path.startswith(str(NETNS_DIR)) else os.readlink(path).split(":")[0]
        ns = f"{kind}:[{os.fstat(fd).st_ino}]"
        if ns in self._ns_fds:
            os.close(fd)
        else:
            self._ns_fds[ns] = fd

    def _release_dead_mount_ns(self) -> None:
        """Let go of the mount ns of earlier holders that nothing uses any more."""
        used = set()
        for pid in _pids():
            with contextlib.suppress(OSError):
                used.add(os.readlink(f"/proc/{pid}/ns/mnt"))
        for ns in [ns for ns in self._ns_fds if ns.startswith("mnt:") and ns not in used]:
            os.close(self._ns_fds.pop(ns))

    def _netns_pids(self, name: str) -> list[int]:
        if not (NETNS_DIR / name).exists():
            return []
        r = self._sh(["ip", "netns", "pids", name], check=False, timeout=10)
        if r.returncode != 0:
            if not (NETNS_DIR / name).exists():
                return []
            raise ClusterError(f"ip netns pids {name}: {r.stderr.strip()}")
        return [int(x) for x in r.stdout.split()]

    def _ns_members(self) -> list[int]:
        """Live processes (not zombies) in a netns or holder mount ns of this cluster."""
        me = os.getpid()
        found = []
        for pid in _pids():
            if pid == me:
                continue
            try:
                net = os.readlink(f"/proc/{pid}/ns/net")
                mnt = os.readlink(f"/proc/{pid}/ns/mnt")
            except OSError:  # gone, or a zombie
                continue
            if net in self._ns_fds or mnt in self._ns_fds:
                found.append(pid)
        return found

    def _reap(self) -> None:
        for p in (*self._user_procs, *(p for n in self._nodes.values() for p in n.procs)):
            p.poll()

    def _spawn_host(
        self, argv: list[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd="/", env=None if env is None else dict(env),
            )

    def _spawn_in(
        self, n: str, argv: list[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        return self._spawn_host([*self._nsenter(n), *argv], log, env)

    @staticmethod
    def _sh(
        argv: Sequence[str], timeout: float = 30.0, check: bool = True, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False,
            stdin=subprocess.DEVNULL, env=None if env is None else dict(env),
        )
        if check and r.returncode != 0:
            raise ClusterError(f"{shlex.join(argv)} -> exit {r.returncode}\n{r.stdout}{r.stderr}".rstrip())
        return r


# --------------------------------------------------------------------------- helpers


def _kill_all(pids: Callable[[], list[int]], timeout: float, interval: float) -> tuple[set[int], list[int]]:
    """SIGKILL whatever ``pids()`` lists until it lists nothing or ``timeout`` passes: (every
    pid killed, those still listed at the end)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while left := pids():
        killed.update(left)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return killed, left
        time.sleep(interval)
    return killed, []


def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _fragment(tag: str, xml: str) -> list[ET.Element]:
    try:
        return list(ET.fromstring(f"<{tag}>{xml}</{tag}>"))
    except ET.ParseError as e:
        raise ValueError(f"{tag} XML: {e}") from None


def _pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def _netns_id(name: str) -> str:
    return f"net:[{os.stat(NETNS_DIR / name).st_ino}]"


def _wait_exec(p: subprocess.Popen[bytes], comm: str, log: Path, timeout: float = 10.0) -> None:
    """Wait until `p` (a chain of exec'ing wrappers: ip netns exec, unshare, nsenter) has
    become `comm`, i.e. its namespaces are all set up."""
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            raise ClusterError(f"{p.args!r} exited with {p.returncode}: {log.read_text(errors='replace')}")
        try:
            if Path(f"/proc/{p.pid}/comm").read_text().strip() == comm:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"{p.args!r} did not become {comm} in {timeout} s")
        time.sleep(0.005)


def _make_entry(path: Path, is_dir: bool) -> None:
    if is_dir:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _mount_points(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [_unescape(line.split()[4]) for line in f]


def _netns_dir_state() -> tuple[bool, int]:
    """(whether /run/netns exists, how many mounts sit on it)."""
    return NETNS_DIR.is_dir(), _mount_points().count(str(NETNS_DIR))


def _restore_netns_dir(state: tuple[bool, int]) -> list[str]:
    """`ip netns add` may have created /run/netns and bind-mounted it onto itself: undo
    what was not there before, if it is empty."""
    existed, mounts = state
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return []
    problems = []
    while _mount_points().count(str(NETNS_DIR)) > mounts:
        r = subprocess.run(
            ["umount", str(NETNS_DIR)], capture_output=True, text=True, timeout=10, check=False
        )
        if r.returncode != 0:
            problems.append(f"umount {NETNS_DIR}: {r.stderr.strip()}")
            break
    if not existed:
        try:
            NETNS_DIR.rmdir()
        except OSError as e:
            problems.append(f"rmdir {NETNS_DIR}: {e}")
    return problems

