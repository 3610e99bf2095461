"""Secrets out of what people read: a URI's password and secret query values, and the same in
a command line (``--tracking-uri postgresql://u:pw@h/db``), replaced by ``***``.

Used wherever a tracking URI or a command is printed, logged, tagged or written to a file (the
run folder's lock record), so a store's credentials never leave the environment they came in."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# Query parameters that carry a secret (libpq's password / sslpassword, tokens, keys, signatures):
# matched anywhere in the name, case-insensitively (``sslpassword``, ``api_key``, ``X-Amz-Signature``).
SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|auth|credential|signature", re.IGNORECASE)


def mask_uri(uri: str) -> str:
    """``uri`` as shown to people (printed, logged, tagged): the userinfo password and the values
    of secret-carrying query parameters replaced by ``***``; the rest kept as written.

    ``postgresql://u:pw@h/db?sslmode=require&password=pw``
    -> ``postgresql://u:***@h/db?sslmode=require&password=***``"""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")  # a password may itself contain '@'
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep else netloc
    query = "&".join(_mask_param(p) for p in parts.query.split("&")) if parts.query else parts.query
    if (netloc, query) == (parts.netloc, parts.query):
        return uri  # untouched, byte for byte (urlunsplit may normalise an empty query or fragment)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _mask_param(param: str) -> str:
    name, sep, value = param.partition("=")
    return f"{name}={MASK}" if sep and value and SECRET_PARAM.search(name) else param


def mask_command(argv: list[str]) -> list[str]:
    """``argv`` with every URI in it masked (``mask_uri``), as a separate argument or as the value
    of ``--option=URI``; other arguments unchanged."""

    def one(arg: str) -> str:
        option, sep, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        return f"{option}{sep}{mask_uri(value)}" if "://" in value else arg

    return [one(a) for a in argv]
