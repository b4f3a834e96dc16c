"""Stored outcomes encrypted at rest: AES-256-GCM under a key ring whose keys rotate.

Give a guard a `KeyRing` and every response or return value it stores, and every recovery
point, is sealed before it reaches the store and opened when it is replayed; the stores keep
the bytes they are given, so this holds for every store (memory, SQLite, PostgreSQL, MariaDB,
Redis, the local cache) and every surface (functions, HTTP, consumers)::

    ring = KeyRing.from_env("IDEMPO_ENCRYPTION_KEYS")     # "2026-12:<base64>,2026-06:<base64>"
    idem = Idempotency(store, encryption=ring)
    app = IdempotencyMiddleware(app, store=store, encryption=ring)

**Sealed form.** ``b"\\x00idmp"``, a format version byte (1), the key id's length and the
key id (ASCII), a random 12-byte nonce, then the AES-GCM ciphertext with its 16-byte tag. The
associated data is that header and the record's place: its scope (principal, operation, key)
and what the bytes are (a COMPLETED or FAILED outcome, a recovery point). A sealed value
copied to another scope, or a COMPLETED one relabelled FAILED, no longer opens. Recovery
points are text in the stores: their sealed form is ``idempo:sealed:`` and the sealed bytes
in unpadded URL-safe base64.

**What cannot be opened is never replayed, nor run again.** A key id the ring does not
hold, bytes that do not authenticate, or a record stored in plaintext (unless the ring
accepts them, ``accept_plaintext``) raise `UndecryptableRecordError`, a `CorruptRecordError`:
nothing runs, nothing is replayed, the HTTP middlewares answer the ``corrupt-record`` 503,
until the key is back in the ring or the record is evicted. A guard without a ring that
meets a sealed record raises the same. docs/data-at-rest.md says what stays in plaintext.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._core.digest import key_ref
from ._core.keys import Scope, evict_hint
from ._core.record import Record, Status
from ._optional import optional_import
from .errors import ConfigurationError, UndecryptableRecordError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "KEY_BYTES",
    "KeyRing",
    "SealedCodec",
    "generate_key",
    "is_sealed",
    "record_context",
    "sealed_key_id",
]

MAGIC = b"\x00idmp"
_VERSION = 1
NONCE_BYTES = 12
KEY_BYTES = 32
"""AES-256: every key is 32 bytes (`generate_key` makes one)."""
POINT_PREFIX = "idempo:sealed:"
# Safe in an environment string ("id:base64,id:base64") and in a log line.
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEAD = len(MAGIC) + 2  # magic, version, key id length


def generate_key() -> str:
    """A new random 32-byte key, base64: what `KeyRing` and `KeyRing.parse` take.

    >>> import base64
    >>> len(base64.b64decode(generate_key()))
    32
    """
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


def is_sealed(data: bytes | None) -> bool:
    """Whether stored bytes are sealed by a `KeyRing` (they start with its header).

    >>> is_sealed(b'{"id":1}'), is_sealed(None)
    (False, False)
    """
    return data is not None and data[: len(MAGIC)] == MAGIC


def sealed_key_id(data: bytes | None) -> str | None:
    """The id of the key that sealed ``data``, read from its header (what ``idempo inspect``
    shows); None for bytes that are not sealed, or whose header this version cannot read.

    >>> ring = KeyRing({"2026-12": generate_key()})
    >>> sealed_key_id(ring.seal(b"{}", b"")), sealed_key_id(b"{}")
    ('2026-12', None)
    """
    if data is None or not is_sealed(data):
        return None
    try:
        return _key_id_of(data)
    except UndecryptableRecordError:
        return None


def _key_id_of(data: bytes) -> str:
    """The key id in a sealed header (``data`` starts with `MAGIC`)."""
    if len(data) < _HEAD or data[len(MAGIC)] != _VERSION:
        raise UndecryptableRecordError("its sealed format is not one this version reads")
    try:
        return data[_HEAD : _HEAD + data[_HEAD - 1]].decode("ascii")
    except UnicodeDecodeError:
        raise UndecryptableRecordError("its key id is not ASCII") from None


def record_context(scope: Scope, what: str) -> bytes:
    """The associated data that binds sealed bytes to their place: ``what`` they are (a
    status's value, or ``"point"``) and the scope, each part length-prefixed so that no two
    places encode alike.

    >>> record_context(Scope("u1", "pay", "k1"), "completed")
    b'completed|2:u13:pay2:k1'
    """
    # One formatting operation: this runs on every sealed call.
    principal, operation, key = _utf8(scope.principal), _utf8(scope.operation), _utf8(scope.key)
    return b"%s|%d:%s%d:%s%d:%s" % (
        what.encode(),
        len(principal),
        principal,
        len(operation),
        operation,
        len(key),
        key,
    )


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _header(key_id: str) -> bytes:
    return MAGIC + bytes([_VERSION, len(key_id)]) + key_id.encode()


def _key_material(key_id: str, material: bytes | str) -> bytes:
    if isinstance(material, str):
        # Standard or URL-safe base64, padded or not.
        text = material.strip().replace("-", "+").replace("_", "/")
        try:
            material = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            material = b""
    if not isinstance(material, bytes | bytearray) or len(material) != KEY_BYTES:
        # The material itself is never echoed: it is a secret, and messages reach logs.
        raise ConfigurationError(
            f"encryption key {key_id!r} must be {KEY_BYTES} bytes (AES-256), raw or base64;"
            " make one with idempo.encryption.generate_key()"
        )
    return bytes(material)


class KeyRing:
    """The keys that seal stored outcomes (AES-256-GCM): ``current`` seals every new record,
    every key in the ring opens the records it sealed. Rotate by adding a new key as current
    and keeping the old one until its records' retention (the policy's ``ttl``) has passed.

    Args:
        keys: key id → 32-byte key, raw or base64. Key ids: 1-64 of ``A-Z a-z 0-9 . _ -``
            (a date such as ``"2026-12"`` tells when to retire it). Each id is stored in
            every record it seals, so it is no secret.
        current: the id of the key that seals; may be left out when the ring holds one key.
        accept_plaintext: replay records stored before encryption was turned on (no sealed
            header) as they are, instead of refusing them. For the changeover only (one
            retention period): while it is on, whoever can write to the store can plant a
            plaintext record that is replayed.

    Raises:
        ConfigurationError: no keys, a malformed id or key, an unknown ``current``, or
            ``cryptography`` missing (``pip install 'idempo[encryption]'``).

    >>> from idempo import Scope
    >>> ring = KeyRing({"2026-12": generate_key()})
    >>> sealed = ring.seal(b"secret", record_context(Scope("", "pay", "k1"), "completed"))
    >>> b"secret" in sealed, ring.open(sealed, record_context(Scope("", "pay", "k1"), "completed"))
    (False, b'secret')
    >>> ring
    KeyRing(current='2026-12', key_ids=('2026-12',))
    """

    __slots__ = (
        "_ciphers",
        "_current",
        "_encrypt",
        "_header",
        "_headers",
        "_invalid",
        "accept_plaintext",
    )

    def __init__(
        self,
        keys: Mapping[str, bytes | str],
        current: str | None = None,
        *,
        accept_plaintext: bool = False,
    ) -> None:
        with optional_import("encryption at rest needs cryptography", extra="encryption"):
            from cryptography.exceptions import InvalidTag  # noqa: PLC0415 - optional
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: PLC0415
        if not keys:
            raise ConfigurationError("a KeyRing needs at least one key")
        ciphers: dict[str, AESGCM] = {}
        for key_id, material in keys.items():
            if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
                raise ConfigurationError(f"key id {key_id!r}: 1-64 characters of A-Z a-z 0-9 . _ -")
            ciphers[key_id] = AESGCM(_key_material(key_id, material))
        if current is None:
            if len(ciphers) > 1:
                raise ConfigurationError("a KeyRing with several keys needs current=")
            current = next(iter(ciphers))
        if current not in ciphers:
            raise ConfigurationError(f"current={current!r} is not one of the ring's key ids")
        self._ciphers = ciphers
        self._current = current
        self._encrypt = ciphers[current].encrypt
        # Each key's whole header, to the key: what `open` finds a sealed value's key by.
        self._headers = {_header(key_id): cipher for key_id, cipher in ciphers.items()}
        self._header = _header(current)
        self._invalid = InvalidTag
        self.accept_plaintext = accept_plaintext

    @classmethod
    def parse(
        cls, text: str, *, current: str | None = None, accept_plaintext: bool = False
    ) -> KeyRing:
        """A ring from ``"id:base64,id:base64"`` (the form an environment variable or a
        secret manager holds); the first key is current unless ``current`` names another.

        >>> KeyRing.parse(f"new:{generate_key()}, old:{generate_key()}").current
        'new'
        """
        keys: dict[str, str] = {}
        for item in text.split(","):
            key_id, colon, material = item.strip().partition(":")
            if not colon:
                raise ConfigurationError(
                    "encryption keys are written id:base64, separated by commas"
                )
            if key_id in keys:
                raise ConfigurationError(f"key id {key_id!r} is given twice")
            keys[key_id] = material
        first = next(iter(keys))
        return cls(keys, current or first, accept_plaintext=accept_plaintext)

    @classmethod
    def from_env(
        cls,
        name: str = "IDEMPO_ENCRYPTION_KEYS",
        *,
        current: str | None = None,
        accept_plaintext: bool = False,
    ) -> KeyRing:
        """A ring from the environment variable ``name``, read as `parse` reads text.

        Raises:
            ConfigurationError: the variable is unset or empty, or malformed.
        """
        text = os.environ.get(name, "").strip()
        if not text:
            raise ConfigurationError(f"the environment variable {name} holds no encryption keys")
        return cls.parse(text, current=current, accept_plaintext=accept_plaintext)

    @property
    def current(self) -> str:
        """The id of the key that seals new records."""
        return self._current

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every key id in the ring (each opens what it sealed)."""
        return tuple(self._ciphers)

    def __repr__(self) -> str:
        return f"KeyRing(current={self._current!r}, key_ids={self.key_ids!r})"

    def seal(self, data: bytes, context: bytes) -> bytes:
        """``data`` encrypted under the current key, bound to ``context`` (see
        `record_context`): only `open` with the same context gives it back."""
        nonce = os.urandom(NONCE_BYTES)
        header = self._header
        return header + nonce + self._encrypt(nonce, data, header + context)

    def open(self, data: bytes, context: bytes) -> bytes:
        """What `seal` sealed under ``context``; plaintext as it is, with
        ``accept_plaintext``.

        Raises:
            UndecryptableRecordError: ``data`` is not sealed (and plaintext is refused), is
                of an unknown format, names a key the ring does not hold, or does not
                authenticate under ``context`` (altered, or moved to another place).
        """
        # The usual case first: a header (magic, version, key id) the ring knows, whole.
        end = _HEAD + data[_HEAD - 1] if len(data) >= _HEAD else 0
        cipher = self._headers.get(data[:end])
        if cipher is not None:
            try:
                plain: bytes = cipher.decrypt(
                    data[end : end + NONCE_BYTES], data[end + NONCE_BYTES :], data[:end] + context
                )
            except (self._invalid, ValueError):
                key_id = data[_HEAD:end].decode("ascii")
                raise UndecryptableRecordError(
                    f"it does not authenticate under key {key_id!r}: it was altered, or copied"
                    " from another scope or status",
                    key_id=key_id,
                ) from None
            return plain
        return self._unopened(data)

    def _unopened(self, data: bytes) -> bytes:
        """Plaintext, with ``accept_plaintext``; else why ``data`` cannot be opened."""
        if data[: len(MAGIC)] != MAGIC:
            if self.accept_plaintext:
                return data
            raise UndecryptableRecordError(
                "it is stored in plaintext and the key ring does not accept plaintext records"
            )
        key_id = _key_id_of(data)
        raise UndecryptableRecordError(
            f"it was sealed with key {key_id!r}, which is not in the key ring"
            f" (it holds {', '.join(self._ciphers)})",
            key_id=key_id,
        )

    def seal_point(self, point: str, scope: Scope) -> str:
        """A recovery point as the store keeps it: sealed, as text.

        >>> ring = KeyRing({"k": generate_key()}); scope = Scope("", "ship", "o-1")
        >>> sealed = ring.seal_point('{"steps":["charge"]}', scope)
        >>> sealed.startswith("idempo:sealed:"), ring.open_point(sealed, scope)
        (True, '{"steps":["charge"]}')
        """
        sealed = self.seal(_utf8(point), record_context(scope, "point"))
        return POINT_PREFIX + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()

    def open_point(self, stored: str, scope: Scope) -> str:
        """The recovery point `seal_point` sealed (plaintext as it is, with
        ``accept_plaintext``); raises `UndecryptableRecordError` as `open` does, naming the
        record and how to evict it."""
        try:
            if not stored.startswith(POINT_PREFIX):
                if self.accept_plaintext:
                    return stored
                raise UndecryptableRecordError(
                    "it is stored in plaintext and the key ring does not accept plaintext records"
                )
            text = stored[len(POINT_PREFIX) :]
            try:
                data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            except (binascii.Error, ValueError):
                raise UndecryptableRecordError("its sealed text is not base64") from None
            return self.open(data, record_context(scope, "point")).decode("utf-8", "surrogatepass")
        except UndecryptableRecordError as exc:
            raise unreadable(scope, "recovery point", exc) from exc


def unreadable(scope: Scope, what: str, exc: UndecryptableRecordError) -> UndecryptableRecordError:
    """``exc`` told of the record it is about: by its key's digest, with the evict hint."""
    return UndecryptableRecordError(
        f"the stored {what} of {key_ref(scope.key)} (operation {scope.operation!r}) cannot"
        f" be decrypted: {exc}. Nothing was run or replayed: give the guard a key ring that"
        f" holds the record's key, or, to evict the record, {evict_hint(scope)}",
        key_id=exc.key_id,
    )


def refuse_sealed(record: Record) -> None:
    """For a guard with no key ring: a sealed record is an `UndecryptableRecordError`,
    never bytes handed to a serializer (which might replay them as they are)."""
    if is_sealed(record.response):
        raise unreadable(
            record.scope,
            f"{record.status.value} response",
            UndecryptableRecordError("it is encrypted, and this guard has no key ring"),
        )


def open_plain_point(point: str, scope: Scope) -> str:
    """For a guard with no key ring: a recovery point as it is stored, unless it is sealed
    (an `UndecryptableRecordError`: the steps it names must not run again)."""
    if point.startswith(POINT_PREFIX):
        raise unreadable(
            scope,
            "recovery point",
            UndecryptableRecordError("it is encrypted, and this guard has no key ring"),
        )
    return point


class SealedCodec:
    """A surface's `Codec` with every stored outcome sealed by ``ring`` and bound to
    ``scope``: what a guard given ``encryption=`` uses, around the surface's own codec,
    for each call.

    >>> from idempo.guard import FunctionCodec
    >>> from idempo.serializers import JsonSerializer
    >>> codec = SealedCodec(FunctionCodec(JsonSerializer(), ()), KeyRing({"k": generate_key()}),
    ...                     Scope("", "pay", "k1"))
    >>> status, stored = codec.encode_result({"card": "4242"})
    >>> status.value, b"4242" in stored, is_sealed(stored)
    ('completed', False, True)
    """

    __slots__ = ("inner", "ring", "scope")

    def __init__(self, inner: Any, ring: KeyRing, scope: Scope) -> None:
        self.inner = inner
        self.ring = ring
        self.scope = scope

    def _sealed(self, status: Status | None, body: bytes) -> bytes:
        if status is None:
            return body  # nothing is stored: the key is released
        return self.ring.seal(body, record_context(self.scope, status.value))

    def encode_result(self, value: Any) -> tuple[Status | None, bytes]:
        status, body = self.inner.encode_result(value)
        return status, self._sealed(status, body)

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        status, body = self.inner.encode_error(exc)
        return status, self._sealed(status, body)

    def encode_unstorable(self, exc: Exception) -> bytes:
        return self._sealed(Status.FAILED, self.inner.encode_unstorable(exc))

    def open_point(self, point: str) -> str:
        """A taken-over record's recovery point, opened (what the flow asks a codec)."""
        return self.ring.open_point(point, self.scope)

    def decode(self, record: Record) -> Any:
        response = record.response
        status = record.status
        try:
            if response is None:
                if not self.ring.accept_plaintext:
                    raise UndecryptableRecordError("it holds no sealed response")
                return self.inner.decode(record)
            opened = self.ring.open(response, record_context(self.scope, status.value))
        except UndecryptableRecordError as exc:
            raise unreadable(self.scope, f"{status.value} response", exc) from exc
        # Built directly: dataclasses.replace costs more than the decryption.
        return self.inner.decode(
            Record(
                record.scope,
                record.fingerprint,
                status,
                record.token,
                record.lease_expires_at,
                opened,
                record.created_at,
                record.updated_at,
                record.expires_at,
                record.recovery_point,
            )
        )
