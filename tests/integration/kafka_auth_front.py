"""TLS and SASL in front of a plaintext broker: what a managed Kafka asks of a client, here.

Tansu 0.6.0 (the project's development broker, see ``docs/kafka.md``) cannot be run
with working TLS or SASL: ``--cert`` and ``--key`` cannot be given together, its build offers
no PLAIN mechanism, and its only storage engine drops SCRAM credentials. So the tests put
this front before it, as a TLS-terminating proxy (stunnel, a cloud load balancer) would sit
before a broker. The front answers a connection's first requests itself, the way a Kafka
broker does, with real protocol messages:

- ``ApiVersions`` is passed to the broker (a client sends it before authenticating);
- ``SaslHandshake`` (v0-1) picks one of ``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512``;
- ``SaslAuthenticate`` (v0-2) runs that mechanism against the front's users (SCRAM per
  RFC 5802 with the Kafka client's exchange) and answers ``SASL_AUTHENTICATION_FAILED`` (58)
  with a message on a wrong user name or password, then closes the connection.

Once a connection is authenticated (at once without SASL) its bytes are piped to the broker
unchanged. Any other request before authentication closes the connection, as Kafka does.
With a TLS context the front accepts only TLS connections. The broker must advertise the
front's address (``--advertised-listener-url``), so that clients come back through it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import ssl
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 33, 34, 58
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SCRAM_ITERATIONS = 4096
FAILED_AUTHENTICATION_DELAY_S = 0.1
"""A refused client's connection is closed this long after its answer, as Kafka's
``connection.failed.authentication.delay.ms`` (100) does. Closed at once, the client sometimes read
the TLS close before the answer and said "socket disconnected" instead of the broker's reason
(test_wrong_password_fails_naming_the_credentials failed once so in a full run)."""
FAILED = "Authentication failed during authentication due to invalid credentials with SASL mechanism"
"""What Apache Kafka answers to a wrong SASL user name or password (the mechanism follows)."""


def _uvarint(data: bytes, at: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _put_uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _skip_tags(data: bytes, at: int) -> int:
    count, at = _uvarint(data, at)
    for _ in range(count):
        _tag, at = _uvarint(data, at)
        size, at = _uvarint(data, at)
        at += size
    return at


@dataclass
class Request:
    """A request's header fields and where its body starts."""

    api_key: int
    version: int
    correlation_id: int
    body_at: int
    flexible: bool


def parse_header(payload: bytes) -> Request:
    api_key, version, correlation_id = struct.unpack_from(">hhi", payload, 0)
    (client_len,) = struct.unpack_from(">h", payload, 8)
    at = 10 + max(client_len, 0)
    flexible = api_key == SASL_AUTHENTICATE and version >= 2
    if flexible:
        at = _skip_tags(payload, at)
    return Request(api_key, version, correlation_id, at, flexible)


def _frame(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def handshake_response(request: Request, error: int) -> bytes:
    names = b"".join(struct.pack(">h", len(m)) + m.encode() for m in MECHANISMS)
    return _frame(struct.pack(">ihi", request.correlation_id, error, len(MECHANISMS)) + names)


def authenticate_response(request: Request, error: int, message: str | None, auth_bytes: bytes) -> bytes:
    if request.flexible:
        text = b"\x00" if message is None else _put_uvarint(len(message.encode()) + 1) + message.encode()
        body = (
            struct.pack(">i", request.correlation_id)
            + b"\x00"
            + struct.pack(">h", error)
            + text
            + _put_uvarint(len(auth_bytes) + 1)
            + auth_bytes
            + struct.pack(">q", 0)
            + b"\x00"
        )
        return _frame(body)
    text = struct.pack(">h", -1) if message is None else struct.pack(">h", len(message.encode())) + message.encode()
    body = struct.pack(">ih", request.correlation_id, error) + text + struct.pack(">i", len(auth_bytes)) + auth_bytes
    if request.version >= 1:
        body += struct.pack(">q", 0)
    return _frame(body)


def auth_bytes_of(payload: bytes, request: Request) -> bytes:
    if request.flexible:
        size, at = _uvarint(payload, request.body_at)
        return payload[at : at + size - 1]
    (size,) = struct.unpack_from(">i", payload, request.body_at)
    return payload[request.body_at + 4 : request.body_at + 4 + size]


class AuthFailed(Exception):
    """The client's credentials are wrong (the message goes back to it)."""


@dataclass
class Scram:
    """The server side of one SCRAM exchange (RFC 5802), Kafka's way (no channel binding)."""

    hash_name: str
    users: Mapping[str, str]
    step: int = 0
    client_first_bare: str = ""
    server_first: str = ""
    password: str = ""
    salt: bytes = field(default_factory=lambda: os.urandom(16))

    @property
    def mechanism(self) -> str:
        return "SCRAM-" + self.hash_name.upper().replace("SHA", "SHA-")

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.hash_name).digest()

    def respond(self, message: bytes) -> tuple[bytes, bool]:
        """The server's answer to ``message`` and whether the exchange is complete."""
        text = message.decode()
        if self.step == 0:
            self.step = 1
            self.client_first_bare = text.split(",", 2)[2]
            attrs = dict(a.split("=", 1) for a in self.client_first_bare.split(","))
            user = attrs["n"].replace("=2C", ",").replace("=3D", "=")
            if user not in self.users:
                raise AuthFailed(f"{FAILED} {self.mechanism}")
            self.password = self.users[user]
            nonce = attrs["r"] + base64.b64encode(os.urandom(18)).decode()
            self.server_first = f"r={nonce},s={base64.b64encode(self.salt).decode()},i={SCRAM_ITERATIONS}"
            return self.server_first.encode(), False
        without_proof, proof_b64 = text.rsplit(",p=", 1)
        salted = hashlib.pbkdf2_hmac(self.hash_name, self.password.encode(), self.salt, SCRAM_ITERATIONS)
        client_key = self._hmac(salted, b"Client Key")
        stored_key = hashlib.new(self.hash_name, client_key).digest()
        auth_message = f"{self.client_first_bare},{self.server_first},{without_proof}".encode()
        signature = self._hmac(stored_key, auth_message)
        proof = base64.b64decode(proof_b64)
        recovered = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.new(self.hash_name, recovered).digest(), stored_key):
            raise AuthFailed(f"{FAILED} {self.mechanism}")
        server_signature = self._hmac(self._hmac(salted, b"Server Key"), auth_message)
        return b"v=" + base64.b64encode(server_signature), True


class AuthFront:
    """A TLS/SASL front on ``127.0.0.1:port`` for the plaintext broker at ``upstream``.

    ``users``: SASL user name -> password (``None``: no SASL). ``tls``: the server's TLS
    context (``None``: plaintext). Runs its own event loop in a thread: :meth:`start`, :meth:`stop`.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        port: int,
        *,
        users: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self.upstream = upstream
        self.port = port
        self.users = users
        self.tls = tls
        self.failures: list[str] = []
        """Every authentication the front refused, with its reason."""
        self.authenticated: list[str] = []
        """The mechanism of every connection it let through after SASL."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kafka-auth-front", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> AuthFront:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.tls), self._loop
        ).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        try:
            if self.users is None or await self._authenticate(reader, writer, up_reader, up_writer):
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            for w in (writer, up_writer):
                w.close()

    async def _authenticate(self, reader, writer, up_reader, up_writer) -> bool:
        """Run the SASL exchange; whether the connection may go on to the broker."""
        assert self.users is not None
        mechanism: str | None = None
        scram: Scram | None = None
        while True:
            payload = await _read_frame(reader)
            request = parse_header(payload)
            if request.api_key == API_VERSIONS:
                up_writer.write(_frame(payload))
                writer.write(_frame(await _read_frame(up_reader)))
            elif request.api_key == SASL_HANDSHAKE and request.version <= 1:
                (size,) = struct.unpack_from(">h", payload, request.body_at)
                wanted = payload[request.body_at + 2 : request.body_at + 2 + size].decode()
                if wanted not in MECHANISMS:
                    writer.write(handshake_response(request, UNSUPPORTED_SASL_MECHANISM))
                    self.failures.append(f"unsupported mechanism {wanted}")
                    await writer.drain()
                    await asyncio.sleep(FAILED_AUTHENTICATION_DELAY_S)
                    return False
                mechanism = wanted
                if mechanism.startswith("SCRAM-"):
                    scram = Scram(mechanism.removeprefix("SCRAM-").replace("-", "").lower(), self.users)
                writer.write(handshake_response(request, 0))
            elif request.api_key == SASL_AUTHENTICATE and mechanism is not None:
                token = auth_bytes_of(payload, request)
                try:
                    if scram is None:  # PLAIN: authzid NUL user NUL password
                        _authzid, user, password = token.decode().split("\x00")
                        if self.users.get(user) != password:
                            raise AuthFailed(f"{FAILED} PLAIN")
                        answer, done = b"", True
                    else:
                        answer, done = scram.respond(token)
                except AuthFailed as err:
                    self.failures.append(f"{mechanism}: {err}")
                    writer.write(authenticate_response(request, SASL_AUTHENTICATION_FAILED, str(err), b""))
                    await writer.drain()
                    await asyncio.sleep(FAILED_AUTHENTICATION_DELAY_S)
                    return False
                writer.write(authenticate_response(request, 0, None, answer))
                await writer.drain()
                if done:
                    self.authenticated.append(mechanism)
                    return True
            else:
                self.failures.append(f"request {request.api_key} v{request.version} before authentication")
                return False
            await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


@dataclass(frozen=True)
class Certificates:
    """A throw-away CA and a server certificate it signed for ``localhost`` and 127.0.0.1 (PEM files)."""

    ca: str
    server_cert: str
    server_key: str
    other_ca: str
    """A second CA that signed nothing here: a client trusting only it must refuse the front."""
    client_cert: str
    client_key: str
    """A client certificate and its key, signed by ``ca``, for mutual TLS."""

    def server_context(self, mutual: bool = False) -> ssl.SSLContext:
        """The front's TLS context; with ``mutual`` it wants a client certificate signed by ``ca``."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        if mutual:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.ca)
        return ctx


def make_certificates(folder: str) -> Certificates:
    """Write a CA, a server certificate and key, and an unrelated CA into ``folder``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def write(path: str, data: bytes) -> str:
        with open(path, "wb") as f:
            f.write(data)
        return path

    pem = serialization.Encoding.PEM
    ca_key, ca_cert = ca("flywheel test CA")
    _, other_cert = ca("another CA")

    def leaf(common: str, usage: x509.ObjectIdentifier, *names: x509.GeneralName) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return cert.public_bytes(pem), key_pem

    usages = x509.oid.ExtendedKeyUsageOID
    localhost = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server_cert, server_key = leaf("localhost", usages.SERVER_AUTH, *localhost)
    client_cert, client_key = leaf("flywheel-client", usages.CLIENT_AUTH)
    return Certificates(
        ca=write(os.path.join(folder, "ca.pem"), ca_cert.public_bytes(pem)),
        server_cert=write(os.path.join(folder, "server.pem"), server_cert),
        server_key=write(os.path.join(folder, "server.key"), server_key),
        other_ca=write(os.path.join(folder, "other-ca.pem"), other_cert.public_bytes(pem)),
        client_cert=write(os.path.join(folder, "client.pem"), client_cert),
        client_key=write(os.path.join(folder, "client.key"), client_key),
    )
