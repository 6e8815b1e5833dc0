"""Secrets out of text: what aiomm shows of a URL in an error, a log line or a response body.

A URL may carry credentials in its user info (``https://user:secret@host/a.jpg``, a token as
the user name) or in its query (a presigned object-store URL's ``X-Amz-Signature``, an
``access_token``). :func:`redact` masks both wherever a URL appears in a text, malformed URLs
included (``http://user:secret@[::1`` is no URL to a parser, but still a secret): the password
becomes ``***`` (``user:***@``), a user name alone becomes ``***@``, and the value of a query
parameter whose name looks like a credential becomes ``***``. It is idempotent, so each layer
may apply it to what it shows.
"""

from __future__ import annotations

import re

__all__ = ("redact",)

# ``scheme://userinfo@``: the user info ends at the authority's last "@" (RFC 3986: the authority
# ends at the first "/", "?" or "#"), so a password holding "@" is masked whole; a quote ends it
# too (a URL quoted in a message).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/?#\s'\"<>`]*)@")
# ``?name=value`` / ``&name=value`` where the name holds one of these words; a quote or bracket
# ends the value (a URL quoted in a message)
_SECRET_QUERY = re.compile(
    r"(?i)([?&;][^=&#\s]*(?:token|sig|secret|pass|credential|key|auth|session)[^=&#\s]*=)"
    r"([^&#\s'\"<>()]+)"
)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, sep, _password = match[2].partition(":")
    if not sep:  # a user name alone is often the token itself
        return f"{match[1]}***@"
    return f"{match[1]}{user}:***@"


def redact(text: str, *, source: str | None = None) -> str:
    """``text`` with every URL's user info password (or lone user name) and credential-like
    query values replaced by ``***``.

    ``source``: the URL the text is about; its secrets are masked wherever they appear in
    ``text``, also outside a URL (a parser's message quoting a piece of it). Secrets shorter
    than 3 characters are masked only inside URLs (elsewhere they would mask ordinary words).
    """
    if source is not None:
        for secret in _secrets(source):
            text = text.replace(secret, "***")
    if "@" in text:
        text = _USERINFO.sub(_mask_userinfo, text)
    if "=" in text:
        text = _SECRET_QUERY.sub(r"\1***", text)
    return text


def _secrets(url: str) -> list[str]:
    found: list[str] = []
    for match in _USERINFO.finditer(url):
        user, sep, password = match[2].partition(":")
        found.append(password if sep else user)
    found.extend(match[2] for match in _SECRET_QUERY.finditer(url))
    # longest first: a secret holding another is masked whole
    return sorted((s for s in found if len(s) >= 3 and s != "***"), key=len, reverse=True)
