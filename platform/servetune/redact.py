"""Secret redaction: the one set of rules for everything servetune writes down.

Every text that leaves the process (MLflow params, tags and artifacts, the Parquet dataset, the
spec summary, error messages) passes through here. The rules, in the order they apply:

* a key that names a secret (:func:`is_secret_key`: ``HF_TOKEN``, ``api_key``, ``db.password``)
  has its whole value masked;
* the values of secret-named environment variables (6 characters or longer) are masked wherever
  they appear;
* token-shaped strings (Hugging Face, OpenAI-style, GitHub, AWS access keys, bearer headers) are
  masked;
* secret query parameters of a URL (``?password=``, ``&token=``, ...) are masked;
* URL credentials: in free text (:func:`redact_text`) the whole user info goes, since a user name
  can itself be a token (``https://hf_xxx@host``); in a URL the user configured
  (:func:`redact_url`, e.g. ``storage.optuna_url``) only the password goes, so the summary still
  says which database user the study connects as.

Example:
    >>> redact_text("pull https://user:pw@hub.example/m with hf_abcdefgh12345", environ={})
    'pull https://***@hub.example/m with ***'
    >>> redact_url("postgresql://optuna:hunter2@db:5432/optuna?sslmode=require&password=x", environ={})
    'postgresql://optuna:***@db:5432/optuna?sslmode=require&password=***'
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "is_secret_key", "redact_text", "redact_url", "redact"]

MASK = "***"

# TOKEN may end a compound word (ACCESSTOKEN); KEY must be its own word, or "monkey" would match.
_SECRET_KEY_END = re.compile(r"TOKEN$|(?:^|[^A-Z0-9])KEY(?:_ID)?$")
_SECRET_KEY_WORDS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "APIKEY", "PRIVATE_KEY", "AUTHORIZATION")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#]*)(.*)", re.S)
# A scheme is tried only where a run of scheme characters begins (the lookbehind), after the run's
# leading non-letters: one scan per run, so the time is linear in the text (without the lookbehind a
# 1 MB word was scanned from each of its letters: 80 kB took 9 s).
_URL_CREDENTIALS = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<pre>[0-9+.\-]*)(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@:]*(?::[^/\s@]*)?@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:password|passwd|pwd|token|secret|api_key|apikey|access_key|secret_key|key)=)[^&#;\s]*")
# Token shapes of the services a vLLM deployment talks to: Hugging Face, OpenAI-style, GitHub,
# AWS access keys, bearer headers.
_TOKEN_SHAPES = re.compile(
    r"\bhf_[A-Za-z0-9]{8,}|\bsk-[A-Za-z0-9_\-]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}|\bAKIA[0-9A-Z]{16}\b"
    r"|(?i:bearer)\s+[A-Za-z0-9._\-~+/]{8,}=*"
)


def is_secret_key(key: str) -> bool:
    """Whether a param/tag/env name names a secret (``HF_TOKEN``, ``api_key``, ``db.password``).

    ``max_num_batched_tokens`` and ``kv_cache_tokens`` are counts, not secrets: only a name that
    *ends* in TOKEN, or in KEY as a word of its own, counts.

    Example:
        >>> [is_secret_key(k) for k in ("HF_TOKEN", "hf.token", "openai_api_key", "DB_PASSWORD", "max_num_batched_tokens")]
        [True, True, True, True, False]
    """
    upper = key.upper()
    return bool(_SECRET_KEY_END.search(upper)) or any(word in upper for word in _SECRET_KEY_WORDS)


def _env_secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named environment variables, longest first (so no partial masking)."""
    env = os.environ if environ is None else environ
    return list(_secret_values_of(tuple(env.items())))


@functools.lru_cache(maxsize=8)
def _secret_values_of(items: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """:func:`_env_secret_values` of one environment's items (the same environment is read for
    every text of a trial: its keys are judged once)."""
    values = {v for k, v in items if is_secret_key(k) and len(v) >= 6}
    return tuple(sorted(values, key=len, reverse=True))


def _mask_secrets(text: str, environ: Mapping[str, str] | None) -> str:
    """The rules both entry points share: env secret values, secret query parameters, token shapes."""
    for secret in _env_secret_values(environ):
        text = text.replace(secret, MASK)
    text = _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, text)
    return _TOKEN_SHAPES.sub(MASK, text)


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Mask URL credentials (the whole user info), token-shaped strings and secret env values
    inside free text."""
    text = _mask_secrets(text, environ)
    return _URL_CREDENTIALS.sub(lambda m: m.group("pre") + m.group("scheme") + MASK + "@", text)


def redact_url(url: str, environ: Mapping[str, str] | None = None) -> str:
    """A configured URL safe to show: the password masked (the user name kept), secret query
    parameters, token shapes and secret env values masked; a URL without credentials unchanged.

    Example:
        >>> redact_url("sqlite:////tmp/x.db"), redact_url("http://user@host/x", environ={})
        ('sqlite:////tmp/x.db', 'http://user@host/x')
    """
    m = _URL.match(url)
    if not m:
        return _mask_secrets(url, environ)
    scheme, netloc, rest = m.groups()
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    return scheme + _mask_secrets(netloc + rest, environ)


def redact(mapping: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A copy of ``mapping`` safe to log: secret-named keys masked, secrets inside values masked.

    Non-string values are kept as they are (numbers and booleans cannot hold a token); nested
    mappings and lists are redacted recursively.

    Example:
        >>> redact({"HF_TOKEN": "hf_x", "max_num_seqs": 64, "url": "s3://k:s@bucket/x"}, environ={})
        {'HF_TOKEN': '***', 'max_num_seqs': 64, 'url': 's3://***@bucket/x'}
    """
    return {str(k): (MASK if is_secret_key(str(k)) else _redact_value(v, environ)) for k, v in mapping.items()}


def _redact_value(value: Any, environ: Mapping[str, str] | None) -> Any:
    if isinstance(value, str):
        return redact_text(value, environ)
    if isinstance(value, Mapping):
        return redact(value, environ)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v, environ) for v in value)
    return value
