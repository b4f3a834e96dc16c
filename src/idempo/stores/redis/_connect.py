"""Clients: built from a store URL (server or cluster) with idempo's defaults, or checked when
the app brings its own."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions
from redis.backoff import NoBackoff

from ...errors import ConfigurationError
from .. import seconds
from ._errors import translating

_DEFAULT_TIMEOUT = 5.0

# What the clients built from a URL re-send once (see from_url): a broken connection.
_RESENT = (redis.exceptions.ConnectionError,)


def check_client(client: Any) -> None:
    if client.get_encoder().decode_responses:
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")


def from_url(
    url: str, options: dict[str, Any], single: Any, cluster: Any, node: Any, retry: Any
) -> Any:
    """A client for ``url``: ``single.from_url``, or for a cluster URL ``cluster.from_url``
    with every seed node (``node`` is the ClusterNode class and ``retry`` the Retry class of
    the same face)."""
    url, options = _client_options(url, options)
    seeds = _cluster_seeds(url)
    if seeds is None:
        # One re-send of a command whose connection broke, as a client built by hand does
        # ten times: every script is safe to run twice (the reserve's nonce, fenced and
        # repeatable settles), and a reply lost with the connection then costs nothing. A
        # timeout is not re-sent: a frozen server would make every call wait twice.
        options.setdefault("retry", retry(NoBackoff(), 1, supported_errors=_RESENT))
        return single.from_url(url, **options)
    first, others = seeds
    # The synchronous cluster client connects at once, to learn the slot map.
    with translating():
        return cluster.from_url(
            first, startup_nodes=[node(host, port) for host, port in others], **options
        )


def _client_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``url`` and redis-py's options, with idempo's ``connect_timeout`` (an option or in the
    URL's query, seconds) as redis-py's ``socket_connect_timeout``, and the defaults."""
    base, _, query = url.partition("?")
    items = [item for item in query.split("&") if item]
    given = [item.partition("=")[2] for item in items if item.startswith("connect_timeout=")]
    if given:
        url = "?".join(
            (base, "&".join(i for i in items if not i.startswith("connect_timeout=")))
        ).rstrip("?")
        options.setdefault("connect_timeout", given[-1])
    if (timeout := options.pop("connect_timeout", None)) is not None:
        options["socket_connect_timeout"] = seconds(timeout)
    options.setdefault("socket_timeout", _DEFAULT_TIMEOUT)
    options.setdefault("socket_connect_timeout", _DEFAULT_TIMEOUT)
    if options.get("decode_responses"):
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")
    return url, options


def _cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """For a ``redis+cluster://`` URL: the URL redis-py reads (its first seed node) and the
    other seeds, as (host, port); None for a plain ``redis://`` URL."""
    parts = urlsplit(url)
    base, _, kind = parts.scheme.partition("+")
    if not kind:
        return None
    if kind != "cluster" or base not in ("redis", "rediss"):
        raise ConfigurationError(
            f"unknown Redis URL scheme {parts.scheme!r}: use redis, rediss, redis+cluster"
            " or rediss+cluster"
        )
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError("Redis Cluster has database 0 only")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for seed in hosts.split(","):
        try:
            node = urlsplit(f"//{seed}")
            port = node.port or 6379
        except ValueError as exc:
            raise ConfigurationError(f"bad Redis Cluster seed node {seed!r}") from exc
        if not node.hostname:
            raise ConfigurationError(f"bad Redis Cluster seed node {seed!r}")
        seeds.append((node.hostname, port))
    first = hosts.split(",", 1)[0]
    return urlunsplit((base, userinfo + at + first, parts.path, parts.query, "")), seeds[1:]


def connect(
    face: str,
    url: str | None,
    client: Any,
    options: dict[str, Any],
    classes: tuple[Any, Any, Any, Any],
) -> tuple[Any, bool]:
    """The client of store ``face``: built from ``url`` with ``classes`` (the face's client,
    cluster client, ClusterNode and Retry), or the app's own; and whether the store owns it."""
    if (url is None) == (client is None):
        raise ConfigurationError(f"give {face} a URL or a client, not both")
    if url is not None:
        return from_url(url, options, *classes), True
    check_client(client)
    return client, False
