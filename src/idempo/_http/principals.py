"""Who asked (SPEC §1): the app's resolver, the user the framework authenticated, a hash of
``Authorization``, or anonymous."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError, PrincipalRequiredError

logger = logging.getLogger("idempo.http")


def default_principal(authorization: Sequence[bytes]) -> str:
    """Who asked, by the Authorization header: its hex SHA-256, ``""`` (anonymous) without one.

    The raw credential is never stored.

    >>> default_principal([]), default_principal([b"Bearer t"])[:12]
    ('', '63a25a26464c')
    """
    if not authorization:
        return ""
    return hashlib.sha256(b"\n".join(authorization)).hexdigest()


# Where a user object keeps its id, in the order asked: Starlette's BaseUser.identity,
# Django's pk, then the names apps' own user classes (Litestar's are the app's) use most.
# Flask-Login's get_id() is asked before all of them. Not display names: two users may
# share one.
_USER_ID_NAMES = ("identity", "pk", "id", "user_id", "sub", "username", "email")


def _user_id(user: Any) -> str | None:
    if isinstance(user, bool):
        return None
    if isinstance(user, str | int | uuid.UUID):
        return str(user) or None
    candidates: list[Any] = []
    get_id = getattr(user, "get_id", None)
    if callable(get_id):
        candidates.append(get_id())
    for name in _USER_ID_NAMES:
        if isinstance(user, Mapping):
            candidates.append(user.get(name))
            continue
        try:
            candidates.append(getattr(user, name, None))
        except NotImplementedError:  # Starlette's BaseUser.identity, left to subclasses
            continue
    for value in candidates:
        if isinstance(value, str | int | uuid.UUID) and not isinstance(value, bool) and str(value):
            return str(value)
    return None


def user_principal(user: Any) -> str | None:
    """``"user:<id>"`` for a user the framework authenticated, None for no user or an
    anonymous one (``is_authenticated`` false).

    The id is the user's own (Flask-Login's ``get_id()``, Starlette's ``identity``, Django's
    ``pk``, or an ``id``/``username``/... attribute or key), never its class: renaming a user
    class between a request and its retry must not make the retry another principal.

    Raises:
        ConfigurationError: the user is authenticated but has none of those ids. Falling back
            to a principal shared by every such user would hand one user another's answer.

    >>> class User:
    ...     is_authenticated = True
    ...     pk = 42
    >>> user_principal(User()), user_principal(None)
    ('user:42', None)
    """
    if user is None:
        return None
    authenticated = getattr(user, "is_authenticated", True)
    if callable(authenticated):  # old Django and Flask-Login made it a method
        authenticated = authenticated()
    if not authenticated:
        return None
    found = _user_id(user)
    if found is None:
        raise ConfigurationError(
            f"idempo cannot tell which user a {type(user).__name__} is (no get_id(), "
            f"{', '.join(_USER_ID_NAMES)}): pass principal= to the idempotency middleware"
        )
    return f"user:{found}"


class _NoResolver:
    def __repr__(self) -> str:
        return "NO_RESOLVER"


NO_RESOLVER: Any = _NoResolver()
"""What `Principals.resolve` is given when the app passed no ``principal=`` resolver."""


class Principals:
    """Who asked, for one middleware (SPEC §1).

    The app's resolver wins: a string is the principal (``""``: anonymous, by the app's own
    choice); None means it could not tell, and the request is refused with
    `PrincipalRequiredError` (401) unless ``allow_anonymous``, when the default applies.
    The default, without a resolver: the user the framework authenticated, else the SHA-256
    of ``Authorization``, else anonymous. An anonymous request that carries cookies is most
    likely a signed-in user of a cookie-session app idempo cannot see; the first one is
    logged as a warning (once per middleware), since anonymous callers share one key space.

    Args:
        allow_anonymous: anonymous callers are expected: a resolver's None falls back to the
            default instead of a 401, and cookies on an anonymous request are not warned of.
        owner: the middleware's name, for the warning.
    """

    def __init__(self, *, allow_anonymous: bool, owner: str) -> None:
        self.allow_anonymous = allow_anonymous
        self.owner = owner
        self._warned = False

    def resolve(
        self,
        chosen: str | None,
        user: Callable[[], Any],
        authorization: Sequence[bytes],
        cookies: bool,
    ) -> str:
        """The principal of one request.

        Args:
            chosen: what the app's resolver returned, or `NO_RESOLVER`.
            user: reads the user the framework authenticated (None when it cannot see one);
                called only when the default is needed.
            authorization: the request's Authorization values.
            cookies: whether the request carries a Cookie header.

        Raises:
            PrincipalRequiredError: the resolver returned None and anonymous is not allowed.
            ConfigurationError: see `user_principal`.
        """
        if isinstance(chosen, str):
            return chosen
        if chosen is None and not self.allow_anonymous:
            raise PrincipalRequiredError(
                "the principal resolver could not tell who sent this request, and this "
                "endpoint does not take anonymous requests"
            )
        found = user_principal(user())
        if found is not None:
            return found
        if authorization:
            return default_principal(authorization)
        if cookies and not self.allow_anonymous and not self._warned:
            self._warned = True
            logger.warning(
                "idempo: %s saw a request with cookies but no principal (no authenticated "
                "user it can see, no Authorization header), so it ran as anonymous, and "
                "anonymous callers share one key space. A cookie-session app must pass "
                "principal= (the signed-in user's id); allow_anonymous=True silences this. "
                "Said once.",
                self.owner,
            )
        return ""
