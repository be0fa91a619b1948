"""The one check of an engine URL: every URL that can reach the fleet (``--engine``, ``rollstream
engines add``, the producer's reading of the registry) passes it, so a typo is refused where it is
typed, or skipped with a warning where it is read, never found by a connection that raises."""

from __future__ import annotations

from urllib.parse import urlsplit

from .errors import ConfigError

MAX_URL = 2048
SCHEMES = ("http", "https")


def check_url(url: object, what: str = "engine URL") -> str:
    """``url`` normalised (scheme lower-cased, no trailing ``/``) when it is http(s) with a host,
    a port in 1..65535 if any, an IPv6 host in brackets, no whitespace; else ``ConfigError``
    naming it. Credentials are allowed here (``--engine``); the registry refuses them itself."""
    if not isinstance(url, str) or len(url) > MAX_URL or any(c.isspace() for c in url):
        raise ConfigError(f"{what} {url!r}: at most {MAX_URL} characters, no whitespace")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", "could not be cast"
        raise ConfigError(f"{what} {url!r}: {exc} (an IPv6 host goes in brackets: http://[::1]:8000)") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.hostname:
        raise ConfigError(f"{what} {url!r} must be http:// or https:// with a host")
    host_part = parts.netloc.rpartition("@")[2]
    if ":" in parts.hostname and not host_part.startswith("["):
        raise ConfigError(f"{what} {url!r}: an IPv6 host goes in brackets (http://[::1]:8000)")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"{what} {url!r}: port {port} is not in 1..65535")
    if host_part.endswith(":"):
        raise ConfigError(f"{what} {url!r}: an empty port")
    return (scheme + url[len(parts.scheme):]).rstrip("/")
