"""Keys and the scope they live in."""

from __future__ import annotations

import shlex
import uuid
from dataclasses import dataclass

from ..errors import InvalidKeyError
from .digest import key_digest

MAX_KEY_LENGTH = 255


def validate_key(key: object) -> str:
    """Return ``key`` if it is 1-255 printable ASCII characters (0x21-0x7E), else raise.

    >>> validate_key("order-42")
    'order-42'
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"an idempotency key must be a string, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("the idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"the idempotency key is {len(key)} characters; the limit is 255")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise InvalidKeyError("the idempotency key must be printable ASCII without spaces")
    return key


# Fixed for ever: changing either namespace would give every intent in flight a new downstream
# key during a deploy, and the PSP would charge twice. They are uuid5(NAMESPACE_URL, ...) of
# "https://idempo.dev/ns/derive_key" and ".../step_key"; the literals are what counts.
DERIVE_NAMESPACE = uuid.UUID("01ea8efc-2f92-5b98-9291-8509c8ea3fb4")
STEP_NAMESPACE = uuid.UUID("71195008-5794-52e8-91b0-75ffb5a392d8")


def _pair(first: str, second: str) -> str:
    # Length-prefixed, so ("a:b", "c") and ("a", "b:c") never encode alike.
    return f"{len(first)}:{first}{second}"


def derive_key(parent_key: str, label: str) -> str:
    """The downstream key for the call named ``label`` made on behalf of ``parent_key``.

    Deterministic (a UUIDv5 over both), so every retry of the parent sends the same key to the
    payment provider, the mailer or the DRM vendor, and a re-execution of the parent is
    harmless one level down. Distinct parents or labels give distinct keys.

    Args:
        parent_key: the key of the intent being served; must be a valid key.
        label: names the downstream call (``"psp.charge"``, ``"mail.receipt"``); any
            non-empty string.

    >>> derive_key("order-42", "psp.charge")
    '34980a23-113f-5584-a264-b86070b79a74'
    >>> derive_key("order-42", "psp.charge") == derive_key("order-42", "psp.charge")
    True

    .. versionadded:: 0.1
    """
    validate_key(parent_key)
    if not isinstance(label, str) or not label:
        raise InvalidKeyError("a derived key's label must be a non-empty string")
    return str(uuid.uuid5(DERIVE_NAMESPACE, _pair(parent_key, label)))


def step_key(saga_id: str, step: str) -> str:
    """The key of one step of an orchestrated saga: the readable ``saga_id:step``.

    ``saga_id`` must be a valid key; ``step`` printable ASCII without spaces or ``:`` (so the
    last ``:`` always separates the step). Where ``saga_id:step`` would pass the 255-character
    limit, the key is a UUIDv5 over both instead: still deterministic and distinct, no longer
    readable.

    >>> step_key("saga-7", "reserve-stock")
    'saga-7:reserve-stock'

    .. versionadded:: 0.1
    """
    validate_key(saga_id)
    validate_key(step)
    if ":" in step:
        raise InvalidKeyError(f"a saga step name cannot contain ':' (got {step!r})")
    readable = f"{saga_id}:{step}"
    if len(readable) <= MAX_KEY_LENGTH:
        return readable
    # A UUID has no ':', so it never equals a readable step key.
    return str(uuid.uuid5(STEP_NAMESPACE, _pair(saga_id, step)))


@dataclass(frozen=True, slots=True, init=False)
class Scope:
    """Where a key is unique: the same key from another principal or operation never collides.

    ``principal`` is who asked (``""`` for anonymous), ``operation`` what was asked.
    """

    principal: str
    operation: str
    key: str

    def __init__(self, principal: str, operation: str, key: str) -> None:
        # Set through the slots: a frozen dataclass's generated __init__ goes through
        # object.__setattr__ for each field, about twice the cost, on every guarded call.
        _set_principal(self, principal)
        _set_operation(self, operation)
        _set_key(self, key)

    @classmethod
    def of(cls, key: str, *, operation: str, principal: str = "") -> Scope:
        """Build a scope, validating the key."""
        return cls(principal, operation, validate_key(key))


# The fields' slots (what the frozen instance's own __setattr__ refuses to set).
_set_principal = Scope.__dict__["principal"].__set__
_set_operation = Scope.__dict__["operation"].__set__
_set_key = Scope.__dict__["key"].__set__


def evict_hint(scope: Scope) -> str:
    """The command that evicts ``scope``'s record, for messages about a corrupt one. It
    names neither the key (its digest only, `key_ref`) nor the principal, since the
    message may end up in a log: the operator fills in the key the app sent and the
    principal it was stored under.

    >>> command, why = evict_hint(Scope("user:7", "pay", "k1")).split(" (")
    >>> command
    'idempo evict STORE-URL KEY --operation pay --principal PRINCIPAL'
    >>> why
    'KEY: the key whose digest is 6ab9f1eb8f7d3388)'
    """
    return (
        f"idempo evict STORE-URL KEY --operation {shlex.quote(scope.operation)} --principal"
        f" PRINCIPAL (KEY: the key whose digest is {key_digest(scope.key)})"
    )
