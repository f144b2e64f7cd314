"""Automatic failover under Pacemaker: the logic behind the OCF resource agent
(mount/ocf/rpmemfs, a thin wrapper that runs `rpmemfs ha ACTION`).

One promotable clone per pool. On every node of the clone the pool's copy is the file
POOL_DIR/NAME; unpromoted, the node's own target daemon serves it as a replica; promoted, the
node mounts it as the primary, replicated to every other node's target. docs/ha.md says how to
set it up and what each failure does.

- ocf.py: the agent's exit codes, parameters and meta-data (OCF resource agent API 1.1);
- config.py: the parameters read from the environment Pacemaker passes, checked;
- target_daemon.py: this node's target daemon, started and stopped;
- survey.py: where every copy of the pool stands (header epoch, position stamp);
- election.py: which copy a promote takes, and whether enough copies were reached;
- promote.py: the takeover, onto this node's copy;
- agent.py: the actions.
"""
