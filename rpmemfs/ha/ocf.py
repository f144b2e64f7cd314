"""The OCF resource agent API 1.1 as this agent uses it: exit codes, parameters, meta-data.

The parameters are described once, here: the meta-data Pacemaker reads and the defaults
config.py applies come from the same table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr


class Ocf(enum.IntEnum):
    SUCCESS = 0
    ERR_GENERIC = 1
    ERR_ARGS = 2
    ERR_UNIMPLEMENTED = 3
    ERR_PERM = 4
    ERR_INSTALLED = 5
    ERR_CONFIGURED = 6
    NOT_RUNNING = 7
    RUNNING_PROMOTED = 8
    FAILED_PROMOTED = 9


class OcfError(Exception):
    """An action ends with ``code``; the message goes to the agent's stderr, which Pacemaker
    logs (and shows in `crm_mon` as the failed action's reason)."""

    def __init__(self, code: Ocf, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Param:
    name: str
    short: str
    long: str
    default: str = ""
    required: bool = False
    unique: bool = False


PARAMS: tuple[Param, ...] = (
    Param("pool", "pool name",
          "The pool's name: its copy on every node is the file POOL_DIR/NAME, served by that "
          "node's target daemon under NAME while the node is not promoted.",
          required=True, unique=True),
    Param("directory", "mount point",
          "Where the promoted node mounts the pool (made when missing).", required=True,
          unique=True),
    Param("nodes", "every node and its target's address",
          "Every node that holds a copy, this one included, as NODE=HOST:PORT words separated "
          "by spaces (NODE as `crm_node -n` names it). Each node's target daemon listens on its "
          "HOST:PORT; the promoted node's replicas are all the others. A promote needs a "
          "majority of these copies reachable.", required=True),
    Param("pool_dir", "directory of this node's copy",
          "The target daemon's pool directory (mode 0700, made when missing).",
          default="/var/lib/rpmemfs/ha"),
    Param("size", "size of a new pool",
          "When no node holds a copy yet, and every node's target answers, the first promote "
          "makes the pool with this size (e.g. 1G) and its replicas on the other nodes. Empty: "
          "such a promote fails, and the pool must be made by hand (docs/ha.md)."),
    Param("token_file", "token file",
          "The token every node's target requires and every initiator proves (the same file "
          "on every node: `rpmemfs token FILE`).", default="/etc/rpmemfs/token"),
    Param("min_replicas", "replicas an fsync waits for",
          "Empty: half the other nodes, rounded up (1 of 2 with three nodes), so that every "
          "acknowledged fsync is on a majority of the copies and any majority a promote "
          "reaches holds it. Larger is safer and stops fsync while that many replicas are "
          "down; smaller can lose acknowledged writes in a failover."),
    Param("mount_options", "more mount options",
          "Added to the mount's -o (e.g. replication=async,pmem=force); see `rpmemfs mount "
          "--help`."),
    Param("replica_timeout", "seconds a replica may take",
          "The mount's replica_timeout: how long an fsync waits for a replica that stopped "
          "answering before leaving it out, and how long the promoted node's mount waits for a "
          "node that does not answer (twice: asked who owns it, then connected to).", default="3"),
    Param("probe_timeout", "seconds to reach a node at promote",
          "How long a promote waits for each other node's target to answer.", default="2"),
    Param("wire_protection", "aead or none",
          "Traffic between the nodes: aead (encrypted and authenticated) or none (a trusted "
          "link only).", default="aead"),
    Param("target_options", "more target options",
          "Added to the target daemon's command line (see `rpmemfs target --help`)."),
    Param("force_unmount", "stop what holds the mount",
          "true: a demote or stop that finds files open in the mount sends their processes "
          "SIGTERM, then SIGKILL, as ocf:heartbeat:Filesystem does; false: it fails instead.",
          default="true"),
    Param("rpmemfs", "the rpmemfs command",
          "The command the agent runs (read by the agent's wrapper): default, rpmemfs on "
          "PATH, else /usr/local/bin/rpmemfs."),
)

# (action, timeout seconds, interval seconds, role)
ACTIONS: tuple[tuple[str, int, int, str], ...] = (
    ("start", 60, 0, ""),
    ("stop", 60, 0, ""),
    ("promote", 90, 0, ""),
    ("demote", 60, 0, ""),
    ("monitor", 30, 5, "Promoted"),
    ("monitor", 30, 7, "Unpromoted"),
    ("validate-all", 10, 0, ""),
    ("meta-data", 5, 0, ""),
)


def metadata() -> str:
    params = "\n".join(
        f"""  <parameter name="{p.name}" unique="{int(p.unique)}" required="{int(p.required)}">
   <longdesc lang="en">{escape(p.long)}</longdesc>
   <shortdesc lang="en">{escape(p.short)}</shortdesc>
   <content type="string" default={quoteattr(p.default)}/>
  </parameter>""" for p in PARAMS)
    actions = "\n".join(
        f'  <action name="{name}" timeout="{timeout}s"'
        + (f' interval="{interval}s"' if interval else "")
        + (f' role="{role}"' if role else "") + "/>"
        for name, timeout, interval, role in ACTIONS)
    return f"""<?xml version="1.0"?>
<!DOCTYPE resource-agent SYSTEM "ra-api-1.dtd">
<resource-agent name="rpmemfs" version="1.0">
 <version>1.1</version>
 <longdesc lang="en">
A replicated persistent-memory pool, as a promotable clone: on every node the pool's copy is
served to the promoted node by that node's rpmemfs target daemon; the promoted node mounts its
copy as the primary, replicated to all the others. A promote takes the most recent copy among
the nodes it reaches, and refuses without a majority of them. See docs/ha.md.
 </longdesc>
 <shortdesc lang="en">rpmemfs replicated pool (promotable)</shortdesc>
 <parameters>
{params}
 </parameters>
 <actions>
{actions}
 </actions>
</resource-agent>
"""
