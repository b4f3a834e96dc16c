"""The names the HTTP contract puts on the wire (SPEC §4), in one place: the middlewares, the
client transport and the OpenAPI documents all speak them, and must never drift apart."""

from __future__ import annotations

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
PROBLEM_MEDIA_TYPE = "application/problem+json"
# Problem types are URNs: stable identifiers that promise no web page (RFC 9457 §3.1.1
# allows non-resolvable type URIs). docs/problems.md lists them.
PROBLEM_TYPE_BASE = "urn:idempo:problem:"
