"""The target's side of the handshake: version, wire protection, mutual proof of the token
(over an ephemeral X25519 exchange, transport/auth.py), session binding; then, on a protected
connection, everything after the initiator's AUTH is sealed (SockIO.protect)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from rpmemfs.target.authz import Grant, TokenBook
from rpmemfs.target.sessions import SessionTable, TargetSession
from rpmemfs.transport import auth, protection
from rpmemfs.transport.sockio import SockIO
from rpmemfs.transport.stream import FrameReader, PeerClosed, send_all
from rpmemfs.transport.tokens import key_id
from rpmemfs.transport.wire import (
    F_CLOSE,
    HELLO_F_NO_AES,
    HELLO_F_PLAIN,
    HELLO_SIZE,
    KEY_SIZE,
    PROOF_SIZE,
    Cipher,
    Code,
    Frame,
    Hello,
    Op,
    Role,
    WireError,
    error_text,
    pack_header,
)

log = logging.getLogger("rpmemfs.target.handshake")

REFUSE_SEND_TIMEOUT = 1.0


class ClosedBeforeHello(Exception):
    """The peer closed without sending a byte: an initiator's reachability probe (its
    reconnect loop asks so whether this target is back), not a failed handshake."""


class HandshakeRefused(Exception):
    def __init__(self, code: Code, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


async def refuse(sock: SockIO, code: Code, reason: str) -> None:
    """Tell the peer why, if it still listens; the caller closes the connection."""
    text = error_text(reason)
    with trio.move_on_after(REFUSE_SEND_TIMEOUT):
        try:
            await send_all(sock, [pack_header(Op.ERROR, F_CLOSE, 0, 0, len(text), 0, code), text])
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _credentials(hello: Hello, book: TokenBook, sessions: SessionTable
                 ) -> tuple[bytes, Grant, TargetSession | None]:
    """The token the peer must prove it holds, what that token may do, and (for a lane) the
    session it joins. A lane proves its session's token; a control connection, the token
    its HELLO names by key id."""
    if hello.role == Role.LANE:
        session = sessions.get(hello.session_id)
        if session is None:
            raise WireError(Code.BAD_SESSION,
                            "the lane names no live session (its control connection has closed)")
        return session.token, session.grant, session
    found = book.find(hello.session_id)
    if found is None:
        raise WireError(Code.AUTH_FAILED,
                        "authentication failed: the initiator's token is not one this target accepts")
    return found[0], found[1], None


PLAIN_REFUSED = (
    "this target protects its traffic and the initiator asked for none: drop the initiator's "
    "wire_protection=none (mount option) or --wire-protection none, or start the target with "
    "--wire-protection none if the link is trusted"
)
PROTECTED_REFUSED = (
    "this target runs with --wire-protection none (a trusted link only) and the initiator "
    "requires protection: give the initiator --wire-protection none (or the mount option "
    "wire_protection=none), or start the target without --wire-protection none"
)


def _cipher(hello: Hello, protect: bool) -> Cipher:
    plain = bool(hello.flags & HELLO_F_PLAIN)
    if plain and protect:
        raise WireError(Code.PROTECTION, PLAIN_REFUSED)
    if not plain and not protect:
        raise WireError(Code.PROTECTION, PROTECTED_REFUSED)
    if plain:
        return Cipher.NONE
    return protection.choose(initiator_has_aes=not hello.flags & HELLO_F_NO_AES)


async def accept(
    sock: SockIO,
    reader: FrameReader,
    peer: str,
    book: TokenBook,
    sessions: SessionTable,
    info: dict[str, Any],
    before_auth_failure: Callable[[bytes | None], Awaitable[None]] | None = None,
    *,
    protect: bool = True,
) -> tuple[Role, TargetSession]:
    """Run the handshake (under the caller's deadline); HandshakeRefused says why it failed.

    The peer has been told the reason when this raises HandshakeRefused; a failed proof (or
    an unknown token) is told only after ``before_auth_failure`` returns: the throttle, given
    the key id of the token that was to be proved (None: a key id the target does not know).
    """
    try:
        try:
            await reader.fill(HELLO_SIZE)
        except PeerClosed as exc:
            if exc.mid_frame:
                raise
            raise ClosedBeforeHello from None
        raw = bytes(reader.take(HELLO_SIZE))
        hello = Hello.unpack(raw)
        cipher = _cipher(hello, protect)
        token, grant, found = _credentials(hello, book, sessions)
        mine = auth.Ephemeral()
        challenge = Frame(Op.CHALLENGE, length=KEY_SIZE + PROOF_SIZE, imm=cipher).pack()
        transcript = raw + challenge + mine.public
        try:
            keys = auth.derive(token, mine.shared(hello.public), transcript)
        except ValueError:
            raise WireError(Code.BAD_HELLO, "the initiator's public key is not a valid X25519 key") from None
        await send_all(sock, [challenge, mine.public + auth.target_proof(keys, transcript)])
        frame = await reader.header()
        if frame.op != Op.AUTH or frame.length != PROOF_SIZE:
            got = Op(frame.op).name
            raise WireError(Code.BAD_HELLO, f"expected AUTH with a {PROOF_SIZE}-byte proof, got {got}")
        await reader.fill(PROOF_SIZE)
        answer = bytes(reader.take(PROOF_SIZE))
        if cipher != Cipher.NONE:
            if reader.buffered:
                raise WireError(Code.BAD_HELLO, "bytes after the AUTH before the target's OK")
            # Sealed from here on, refusals included: the initiator reads sealed records
            # once it has sent its AUTH.
            sock.protect(cipher, keys.target_to_initiator, keys.initiator_to_target)
    except WireError as exc:
        if exc.code == Code.AUTH_FAILED and before_auth_failure is not None:
            await before_auth_failure(None)
        await refuse(sock, exc.code, exc.reason)
        raise HandshakeRefused(exc.code, exc.reason) from None
    if not auth.same(answer, auth.initiator_proof(keys, transcript)):
        reason = "authentication failed: the initiator does not hold the token it named"
        if before_auth_failure is not None:
            await before_auth_failure(key_id(token))
        await refuse(sock, Code.AUTH_FAILED, reason)
        raise HandshakeRefused(Code.AUTH_FAILED, f"{reason} ({grant.name!r})")
    if found is not None:
        if sessions.get(found.id) is not found:
            reason = "the lane's session ended during its handshake"
            await refuse(sock, Code.BAD_SESSION, reason)
            raise HandshakeRefused(Code.BAD_SESSION, reason)
        session = found
    else:
        session = sessions.new(peer, grant, token)
    payload = session.id + json.dumps(info).encode()
    try:
        await send_all(sock, [Frame(Op.OK, length=len(payload)).pack(), payload])
    except BaseException:
        if hello.role == Role.CONTROL:
            sessions.end(session)
        raise
    return Role(hello.role), session
