"""The agent's parameters, from the environment Pacemaker passes (OCF_RESKEY_NAME), checked.

A configuration error is the administrator's to fix, and Pacemaker must not retry it on
another node as if the node were at fault: ERR_CONFIGURED. Something missing on this node
(the token file) is ERR_INSTALLED, which keeps the resource off this node only.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from rpmemfs.ha.ocf import PARAMS, Ocf, OcfError
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.units import parse_size


@dataclass(frozen=True)
class Node:
    name: str
    address: str  # HOST:PORT of its target daemon


@dataclass(frozen=True)
class HaConfig:
    pool: str
    directory: str
    nodes: tuple[Node, ...]
    me: str
    pool_dir: str
    size: int | None
    token_file: str
    min_replicas: int
    mount_options: tuple[str, ...]
    replica_timeout: float
    probe_timeout: float
    wire_protection: str
    target_options: tuple[str, ...]
    force_unmount: bool
    instance: str  # the resource's id, for its state directory

    @property
    def pool_path(self) -> str:
        return os.path.join(self.pool_dir, self.pool)

    @property
    def mine(self) -> Node:
        return next(n for n in self.nodes if n.name == self.me)

    @property
    def others(self) -> list[Node]:
        return [n for n in self.nodes if n.name != self.me]

    def spec(self, node: Node) -> ReplicaSpec:
        return ReplicaSpec.make(node.address, self.pool, transport="tcp")

    @property
    def majority(self) -> int:
        return len(self.nodes) // 2 + 1

    @property
    def state_dir(self) -> str:
        return os.path.join(os.environ.get("HA_STATE_DIR", "/run/rpmemfs-ha"), self.instance)


def _values(env: Mapping[str, str]) -> dict[str, str]:
    return {p.name: env.get(f"OCF_RESKEY_{p.name}", p.default).strip() for p in PARAMS}


def this_node(env: Mapping[str, str]) -> str:
    """This node's name as Pacemaker knows it: the name it passes, else `crm_node -n`, else the
    host name (what corosync's nodelist names it by default)."""
    if name := env.get("OCF_RESKEY_CRM_meta_on_node"):
        return name
    try:
        done = subprocess.run(["crm_node", "-n"], capture_output=True, text=True, timeout=5,
                              check=False)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return socket.gethostname()


def parse_nodes(text: str) -> tuple[Node, ...]:
    nodes: list[Node] = []
    for word in text.split():
        name, sep, address = word.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not name or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OcfError(Ocf.ERR_CONFIGURED, f"nodes: {word!r} is not NODE=HOST:PORT")
        if any(n.name == name for n in nodes):
            raise OcfError(Ocf.ERR_CONFIGURED, f"nodes: {name} is named twice")
        nodes.append(Node(name, address))
    return tuple(nodes)


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise OcfError(Ocf.ERR_CONFIGURED, f"{name}={text!r}: seconds, above 0")
    return value


def load(env: Mapping[str, str] | None = None, *, me: str | None = None) -> HaConfig:
    """The parameters, checked; OcfError(ERR_CONFIGURED) names the first one that is wrong."""
    env = os.environ if env is None else env
    v = _values(env)
    for p in PARAMS:
        if p.required and not v[p.name]:
            raise OcfError(Ocf.ERR_CONFIGURED, f"parameter {p.name} is required")
    pool = v["pool"]
    if "/" in pool or pool.startswith(".") or pool in ("", ".."):
        raise OcfError(Ocf.ERR_CONFIGURED, f"pool={pool!r}: a name, not a path")
    for name in ("directory", "pool_dir", "token_file"):
        if not os.path.isabs(v[name]):
            raise OcfError(Ocf.ERR_CONFIGURED, f"{name}={v[name]!r}: an absolute path")
    nodes = parse_nodes(v["nodes"])
    me = me or this_node(env)
    if me not in {n.name for n in nodes}:
        raise OcfError(Ocf.ERR_CONFIGURED,
                       f"this node, {me}, is not in nodes= ({' '.join(n.name for n in nodes)})")
    try:
        size = parse_size(v["size"]) if v["size"] else None
    except ValueError as e:
        raise OcfError(Ocf.ERR_CONFIGURED, f"size={v['size']!r}: {e}") from None
    others = len(nodes) - 1
    if v["min_replicas"]:
        if not v["min_replicas"].isdigit() or int(v["min_replicas"]) > others:
            raise OcfError(Ocf.ERR_CONFIGURED,
                           f"min_replicas={v['min_replicas']!r}: 0 to {others} (the other nodes)")
        min_replicas = int(v["min_replicas"])
    else:
        min_replicas = (others + 1) // 2
    if v["wire_protection"] not in ("aead", "none"):
        raise OcfError(Ocf.ERR_CONFIGURED, f"wire_protection={v['wire_protection']!r}: aead or none")
    if v["force_unmount"] not in ("true", "false"):
        raise OcfError(Ocf.ERR_CONFIGURED, f"force_unmount={v['force_unmount']!r}: true or false")
    opts = tuple(o for o in v["mount_options"].replace(",", " ").split() if o)
    for o in opts:
        if o.split("=")[0] in ("min_replicas", "replica_timeout", "token_file", "wire_protection"):
            raise OcfError(Ocf.ERR_CONFIGURED,
                           f"mount_options: {o.split('=')[0]} is a parameter of its own")
    try:
        target_options = tuple(shlex.split(v["target_options"]))
    except ValueError as e:
        raise OcfError(Ocf.ERR_CONFIGURED, f"target_options: {e}") from None
    instance = env.get("OCF_RESOURCE_INSTANCE", pool).split(":")[0]
    return HaConfig(pool=pool, directory=os.path.normpath(v["directory"]), nodes=nodes, me=me,
                    pool_dir=os.path.normpath(v["pool_dir"]), size=size,
                    token_file=v["token_file"], min_replicas=min_replicas, mount_options=opts,
                    replica_timeout=_seconds("replica_timeout", v["replica_timeout"]),
                    probe_timeout=_seconds("probe_timeout", v["probe_timeout"]),
                    wire_protection=v["wire_protection"], target_options=target_options,
                    force_unmount=v["force_unmount"] == "true", instance=instance)


def check_installed(cfg: HaConfig) -> None:
    """What this node must have (validate-all, and before start): ERR_INSTALLED if not."""
    if not os.path.isfile(cfg.token_file):
        raise OcfError(Ocf.ERR_INSTALLED, f"token_file {cfg.token_file} does not exist on {cfg.me} "
                       "(the same file on every node: `rpmemfs token FILE`, then copy it)")
