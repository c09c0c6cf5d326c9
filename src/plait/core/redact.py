"""Passwords out of text bound for logs and error messages. No I/O.

A DSN or URL may carry a password: `postgresql://user:pw@host/db`, `redis://:pw@host`,
`host=h password=pw`, `...?password=pw`. `redact` replaces each with `***` without
parsing the text, so it works on text no parser accepts, and on a parser's complaint
that quotes such text back ("invalid URI ... in: postgresql://u:pw@[::1"). It errs on
the side of hiding: a password holding `@` is hidden whole, and a quoted one holding
spaces too (libpq's `password='p w'`); in a URL such characters must be escaped anyway.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:PASSWORD@ -- up to the last "@" of the token (a password may hold "@").
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@'\"]*:)[^\s'\"]*@")
# password=PASSWORD (or libpq's sslpassword), in a key=value DSN ('quoted', with \'
# escapes) or a URL query.
_PASSWORD = re.compile(
    r"(?i)(?P<head>(?<![a-z])(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s&'\"]*)"
)


def redact(text: str) -> str:
    """`text` with every password in a URL or DSN within it replaced by `***`."""
    text = _USERINFO.sub(rf"\g<head>{MASK}@", text)
    return _PASSWORD.sub(rf"\g<head>{MASK}", text)
