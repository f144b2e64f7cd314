"""Token strength, key ids and the per-pool authorization rules, without a daemon."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rpmemfs.target.authz import AuthzError, Grant, TokenBook, read_authz
from rpmemfs.target.pools import PoolError
from rpmemfs.transport.tokens import (
    MIN_TOKEN_BITS,
    Origin,
    TokenError,
    generated_token,
    key_id,
    new_token_file,
    read_token_file,
    read_tokens,
    refused_hint,
    token_bits,
)


def test_token_bits_count_by_alphabet() -> None:
    assert token_bits(b"ab" * 16) == 128  # 32 hex digits
    assert token_bits(b"Zm9v" * 5 + b"ab") == 132  # base64
    assert token_bits(b"correct horse!!!") == 128  # anything else: bytes
    assert token_bits(b"0123456789abcdef") < MIN_TOKEN_BITS


def test_key_ids_name_tokens_without_being_them() -> None:
    a, b = os.urandom(32), os.urandom(32)
    assert key_id(a) == key_id(a) and key_id(a) != key_id(b) and len(key_id(a)) == 16
    assert a[:16] != key_id(a)


def test_made_and_generated_tokens_are_private_and_long(tmp_path: Path) -> None:
    path = tmp_path / "t"
    new_token_file(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token_bits(read_token_file(str(path))) == 256
    with pytest.raises(FileExistsError):
        new_token_file(str(path))
    state = tmp_path / "state"
    token, where = generated_token(str(state))
    assert (token, where) == generated_token(str(state))  # kept, not made again
    assert stat.S_IMODE(state.stat().st_mode) == 0o700 and where == str(state / "token")


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t"
    new_token_file(str(path))
    path.chmod(0o604)
    with pytest.raises(TokenError, match="mode 0604: group or others may read or change it"):
        read_token_file(str(path))


def test_a_pools_grant_allows_its_patterns_only() -> None:
    g = Grant("alice", admin=False, pools=("alice-*", "shared"))
    assert g.allows("alice-1") and g.allows("shared") and not g.allows("shared2")
    g.check("open", {"name": "alice-x"})
    g.check("info", {})
    for op, request in (("open", {"name": "bob"}), ("evict", {"name": "alice-1"})):
        with pytest.raises(PoolError) as err:
            g.check(op, request)
        assert err.value.code == "denied"
    assert g.visible({"alice-1": 1, "bob": 2}) == {"alice-1": 1}
    admin = Grant("root", admin=True)
    admin.check("evict", {"name": "bob"})
    assert admin.visible({"alice-1": 1, "bob": 2}) == {"alice-1": 1, "bob": 2}


def test_a_token_book_refuses_the_same_token_or_name_twice(tmp_path: Path) -> None:
    book = TokenBook()
    token = os.urandom(32)
    book.add([token], Grant("a", admin=True))
    found = book.find(key_id(token))
    assert found is not None and found[1].name == "a"
    with pytest.raises(AuthzError, match="same token"):
        book.add([token], Grant("b", admin=True))
    with pytest.raises(AuthzError, match="two tokens are named"):
        book.add([os.urandom(32)], Grant("a", admin=False, pools=("x",)))
    tok = tmp_path / "alice"
    new_token_file(str(tok))
    rules = tmp_path / "authz"
    rules.write_text(f"\n# comment\nalice pools {tok} alice-*  # hers\nbad admin {tmp_path / 'none'}\n")
    with pytest.raises(AuthzError, match=r"authz:4: cannot read token file"):
        read_authz(str(rules), book)
    found = book.find(key_id(read_token_file(str(tok))))
    assert found is not None and found[1] == Grant("alice", False, ("alice-*",))


def test_a_token_file_may_hold_several_tokens_one_a_line(tmp_path: Path) -> None:
    """Issue 28: a rotation adds the new token beside the old in the target's own token file;
    the target accepts both, an initiator proves the newest (the last line)."""
    old, new = tmp_path / "old", tmp_path / "new"
    new_token_file(str(old))
    new_token_file(str(new))
    both = tmp_path / "both"
    both.write_bytes(old.read_bytes() + b"\n" + new.read_bytes() + old.read_bytes())
    both.chmod(0o600)
    assert read_tokens(str(both)) == [read_token_file(str(old)), read_token_file(str(new))]
    assert read_token_file(str(both)) == read_token_file(str(new))
    book = TokenBook()
    book.add(read_tokens(str(both)), Grant("default", admin=True))
    for t in (old, new):
        found = book.find(key_id(read_token_file(str(t))))
        assert found is not None and found[1].name == "default"
    assert book.describe() == "default (admin, 2 tokens)"
    both.write_bytes(new.read_bytes() + b"0123456789abcdef\n")
    with pytest.raises(TokenError, match=f"the token in line 2 of {both} holds at most 64 bits"):
        read_tokens(str(both))


def test_an_initiators_token_says_which_file_it_came_from(tmp_path: Path) -> None:
    path = tmp_path / "t"
    new_token_file(str(path))
    token = read_token_file(str(path), Origin.RECORDED)
    assert token == path.read_bytes().strip()
    hint = refused_hint(token)
    assert f"the token file recorded in the pool, {path}" in hint and "--token-file F" in hint
    assert refused_hint(bytes(token)) == ""  # raw bytes (tests, tools) name no file


def test_an_authz_file_others_may_change_or_that_grants_nothing_is_refused(tmp_path: Path) -> None:
    """Issue 30, item 5: whoever may change the file decides who gets in. Others may read it
    (it names token files, it holds none); an empty file is refused as one emptied by mistake."""
    tok = tmp_path / "alice"
    new_token_file(str(tok))
    rules = tmp_path / "authz"
    rules.write_text(f"alice pools {tok} alice-*\n")
    for mode in (0o600, 0o644):
        rules.chmod(mode)
        book = TokenBook()
        read_authz(str(rules), book)
        assert [g.name for g in book.grants()] == ["alice"]
    for mode in (0o666, 0o620, 0o602):
        rules.chmod(mode)
        with pytest.raises(AuthzError, match=f"authorization file {rules} has mode {mode:04o}: group "
                           "or others may change it"):
            read_authz(str(rules), TokenBook())
    rules.chmod(0o600)
    for text in ("", "# alice pools x a-*\n\n"):
        rules.write_text(text)
        with pytest.raises(AuthzError, match="grants nothing"):
            read_authz(str(rules), TokenBook())
    rules.unlink()
    rules.mkdir()
    with pytest.raises(AuthzError, match="is not a regular file"):
        read_authz(str(rules), TokenBook())


def test_authz_lines_give_a_pools_token_a_quota_and_a_pool_count(tmp_path: Path) -> None:
    """Issue 30, item 8: quota=SIZE and pools=N after the patterns (no pool name holds '=')."""
    tok, ops = tmp_path / "alice", tmp_path / "ops"
    new_token_file(str(tok))
    new_token_file(str(ops))
    rules = tmp_path / "authz"
    rules.write_text(f"alice pools {tok} alice-* quota=10G shared pools=4\n")
    book = TokenBook()
    read_authz(str(rules), book)
    alice = book.named("alice")
    assert alice == Grant("alice", False, ("alice-*", "shared"), 10 << 30, 4) and alice.limited
    assert book.describe() == "alice (pools, 1 token, quota 10.0 GiB, at most 4 pools)"
    for line, why in ((f"alice pools {tok} a-* quota=lots", "quota= needs a size like 10G"),
                      (f"alice pools {tok} a-* pools=0", "a limit of 0"),
                      (f"alice pools {tok} a-* pools=2 pools=3", "pools= is given twice"),
                      (f"alice pools {tok} a-* size=1G", "unknown limit 'size=1G'"),
                      (f"alice pools {tok} quota=1G", "needs at least one pool name pattern"),
                      (f"ops admin {ops} quota=1G", "an admin token has no limits")):
        rules.write_text(line + "\n")
        with pytest.raises(AuthzError, match=f"authz:1: .*{why}"):
            read_authz(str(rules), TokenBook())


def test_authz_lines_give_a_token_its_own_connection_cap(tmp_path: Path) -> None:
    """Issue 30, item 2: connections=N on a line of either role (admission.py applies it)."""
    tok, ops = tmp_path / "alice", tmp_path / "ops"
    new_token_file(str(tok))
    new_token_file(str(ops))
    rules = tmp_path / "authz"
    rules.write_text(f"alice pools {tok} alice-* connections=8 shared\nops admin {ops} connections=500\n")
    book = TokenBook()
    read_authz(str(rules), book)
    assert book.named("alice") == Grant("alice", False, ("alice-*", "shared"), max_connections=8)
    ops_grant = book.named("ops")
    assert ops_grant is not None and ops_grant.max_connections == 500
    for line, why in ((f"alice pools {tok} a-* connections=0", "at least 1"),
                      (f"alice pools {tok} a-* connections=many", "a whole number"),
                      (f"alice pools {tok} a-* connections=2 connections=3", "connections= is given twice")):
        rules.write_text(line + "\n")
        with pytest.raises(AuthzError, match=f"authz:1: .*{why}"):
            read_authz(str(rules), TokenBook())
