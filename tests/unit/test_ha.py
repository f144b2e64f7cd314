"""The resource agent's logic without a cluster: its parameters, the copy a promote takes and
when it refuses, the meta-data the wrapper answers with, and the action codes that need no
daemon (rpmemfs/ha/; tests/e2e/test_ha_agent.py drives the actions on real daemons, and
scripts/test-ha.sh on a real Pacemaker cluster)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import trio

from rpmemfs.ha import agent
from rpmemfs.ha.config import load, parse_nodes
from rpmemfs.ha.election import choose
from rpmemfs.ha.ocf import PARAMS, Ocf, OcfError, metadata
from rpmemfs.ha.survey import Copy, Survey
from rpmemfs.ha.survey import survey as survey_copies
from rpmemfs.pool.position import Position

WRAPPER = Path(__file__).resolve().parents[2] / "mount" / "ocf" / "rpmemfs"
NODES = "n1=10.0.0.1:7420 n2=10.0.0.2:7420 n3=10.0.0.3:7420"
UUID = b"u" * 16


def env(**kw: str) -> dict[str, str]:
    base = {"OCF_RESKEY_pool": "app", "OCF_RESKEY_directory": "/mnt/app", "OCF_RESKEY_nodes": NODES,
            "OCF_RESKEY_CRM_meta_on_node": "n1"}
    base.update({k if k.startswith("OCF_") else f"OCF_RESKEY_{k}": v for k, v in kw.items()})
    return base


def copy(node: str, gen: int, seq: int, *, local: bool = False, resync: str | None = None,
         uuid: bytes = UUID, size: int = 1 << 26) -> Copy:
    return Copy(node, local, uuid, size, gen << 32 | 7, Position(seq, 0) if seq >= 0 else None, resync)


def survey(*copies: Copy, reached: list[str] | None = None, **unusable: str) -> Survey:
    s = Survey(copies=list(copies), unusable=dict(unusable))
    s.reached = reached if reached is not None else [c.node for c in copies] + list(unusable)
    return s


# --- parameters


def test_defaults_give_a_majority_policy_and_this_nodes_copy_in_the_pool_dir() -> None:
    cfg = load(env())
    assert cfg.me == "n1" and [n.name for n in cfg.others] == ["n2", "n3"]
    assert cfg.pool_path == "/var/lib/rpmemfs/ha/app"
    assert cfg.min_replicas == 1 and cfg.majority == 2  # 1 replica + the primary of 3 copies
    assert load(env(nodes=NODES + " n4=10.0.0.4:7420 n5=10.0.0.5:7420")).min_replicas == 2
    assert load(env(nodes="n1=h:1 n2=h:2")).min_replicas == 1
    assert str(cfg.spec(cfg.others[0])) == "10.0.0.2:7420/app"


@pytest.mark.parametrize(("kw", "words"), [
    ({"OCF_RESKEY_pool": ""}, "pool is required"),
    ({"pool": "../etc"}, "a name, not a path"),
    ({"directory": "mnt"}, "absolute path"),
    ({"nodes": "n1=10.0.0.1"}, "NODE=HOST:PORT"),
    ({"nodes": "n1=h:1 n1=h:2"}, "named twice"),
    ({"nodes": "n2=h:1 n3=h:2"}, "this node, n1, is not in nodes="),
    ({"min_replicas": "3"}, "0 to 2"),
    ({"size": "lots"}, "size="),
    ({"replica_timeout": "0"}, "seconds, above 0"),
    ({"wire_protection": "tls"}, "aead or none"),
    ({"mount_options": "pmem=force,min_replicas=2"}, "parameter of its own"),
    ({"force_unmount": "yes"}, "true or false"),
])
def test_a_bad_parameter_is_a_configuration_error_naming_it(kw: dict[str, str], words: str) -> None:
    with pytest.raises(OcfError) as e:
        load(env(**kw))
    assert e.value.code is Ocf.ERR_CONFIGURED
    assert words in str(e.value)


def test_nodes_are_parsed_in_order() -> None:
    parsed = parse_nodes("a=h1:1  b=[::1]:2")
    assert [(n.name, n.address) for n in parsed] == [("a", "h1:1"), ("b", "[::1]:2")]


# --- election


def test_the_most_recent_copy_is_taken_and_this_nodes_wins_a_tie() -> None:
    mine = copy("n1", 3, 200, local=True)
    assert choose(survey(mine, copy("n2", 3, 250)), 3, 2).node == "n2"  # a later point
    assert choose(survey(mine, copy("n2", 3, 200)), 3, 2) is mine  # equal: nothing to copy
    assert choose(survey(mine, copy("n2", 3, -1)), 3, 2) is mine  # n2 holds no stamp yet


def test_a_newer_primarys_copy_beats_a_longer_history_of_an_older_one() -> None:
    # n1, an old primary back from the dead, holds writes it never got acknowledged (seq
    # 900); n2 was written by the primary that replaced it: that is the history that counts.
    old = copy("n1", 3, 900, local=True)
    assert choose(survey(old, copy("n2", 4, 300)), 3, 2).node == "n2"


def test_a_copy_whose_resync_was_cut_short_is_never_taken() -> None:
    mixed = copy("n2", 4, 999, resync="a resync by n3 began and did not end")
    assert choose(survey(copy("n1", 4, 100, local=True), mixed), 3, 2).node == "n1"
    with pytest.raises(OcfError, match="resync cut short"):
        choose(survey(mixed, copy("n3", 4, 50, resync="also")), 3, 2)


def test_without_a_majority_of_copies_a_promote_refuses() -> None:
    alone = survey(copy("n1", 3, 100, local=True), reached=["n1"])
    with pytest.raises(OcfError, match="only 1 of 3 copies reached, 2 needed") as e:
        choose(alone, 3, 2)
    assert e.value.code is Ocf.ERR_GENERIC
    # A node that answers without a copy does not count: it cannot hold an acknowledged write.
    empty_peer = survey(copy("n1", 3, 100, local=True), n2="pool 'app' does not exist")
    with pytest.raises(OcfError, match="only 1 of 3"):
        choose(empty_peer, 3, 2)


def test_copies_of_two_pools_are_refused() -> None:
    with pytest.raises(OcfError, match="different pools") as e:
        choose(survey(copy("n1", 3, 1, local=True), copy("n2", 3, 1, uuid=b"v" * 16)), 3, 2)
    assert e.value.code is Ocf.ERR_CONFIGURED


def test_a_new_pool_only_when_every_node_answered_and_none_has_a_copy() -> None:
    nothing = {n: "pool 'app' does not exist" for n in ("n1", "n2", "n3")}
    assert choose(survey(**nothing), 3, 2) is None
    partial = survey(reached=["n1", "n2"], n1="pool 'app' does not exist", n2="pool 'app' does not exist")
    with pytest.raises(OcfError, match="no copy of the pool was reached"):
        choose(partial, 3, 2)
    damaged = survey(n1="bad header", n2="pool 'app' does not exist", n3="pool 'app' does not exist")
    with pytest.raises(OcfError, match="no copy"):
        choose(damaged, 3, 2)


# --- the OCF surface


def test_meta_data_is_valid_and_names_every_parameter_and_action() -> None:
    root = ET.fromstring(metadata().split("\n", 2)[2])
    assert root.get("name") == "rpmemfs" and root.findtext("version") == "1.1"
    names = [p.get("name") for p in root.iter("parameter")]
    assert names == [p.name for p in PARAMS]
    actions = {(a.get("name"), a.get("role")) for a in root.iter("action")}
    for needed in ("start", "stop", "promote", "demote", "validate-all", "meta-data"):
        assert (needed, None) in actions
    assert {("monitor", "Promoted"), ("monitor", "Unpromoted")} <= actions


def test_the_wrapper_answers_meta_data_with_the_agents_own() -> None:
    text = WRAPPER.read_text()
    embedded = re.search(r"cat <<'META'\n(.*?)META\n", text, re.S)
    assert embedded, "mount/ocf/rpmemfs must answer meta-data itself"
    assert embedded.group(1) == metadata(), (
        "mount/ocf/rpmemfs's meta-data differs from rpmemfs/ha/ocf.py's: paste the output of "
        "`rpmemfs ha meta-data` between its META lines")


def test_actions_that_need_no_daemon(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert agent.main("meta-data", {}) == Ocf.SUCCESS
    assert agent.main("migrate_to", env()) == Ocf.ERR_UNIMPLEMENTED
    bad = env(nodes="n1=nohostport")
    assert agent.main("start", bad) == Ocf.ERR_CONFIGURED
    assert agent.main("stop", bad) == Ocf.SUCCESS  # a failed stop would get the node fenced
    missing = env(token_file=str(tmp_path / "nope"))
    assert agent.main("validate-all", missing) == Ocf.ERR_INSTALLED
    assert "does not exist on n1" in capsys.readouterr().err
    here = env(directory=str(tmp_path / "mnt"), pool_dir=str(tmp_path / "pools"),
               OCF_RESOURCE_INSTANCE="app-clone:0")
    assert agent.main("monitor", {**here, "HA_STATE_DIR": str(tmp_path)}) == Ocf.NOT_RUNNING


def test_nodes_outside_the_partition_are_not_asked(tmp_path: Path) -> None:
    cfg = load(env(pool_dir=str(tmp_path)))
    found = trio.run(survey_copies, cfg, None, {"n1"})
    assert found.unreached == {"n2": "not in this node's cluster partition",
                               "n3": "not in this node's cluster partition"}
    assert found.reached == ["n1"] and "does not exist" in found.unusable["n1"]
