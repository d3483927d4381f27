"""GET a URL that someone else chose (a client, generated code), reaching only public addresses.

A server that fetches URLs for others stands inside a network they cannot reach: its own loopback
services, the cloud metadata endpoint (169.254.169.254), private and unique-local ranges, and
every address of its own (recursa.addresses). So each hop (the URL, then every redirect) is
resolved once, every address the name resolves to must be public, and the connection goes to an
address that was checked: the connector's resolver answers with the checked addresses only, so
the name is never looked up again for that hop, while the request keeps the name in its Host
header and as the TLS server name (certificates are verified against the name). A name that
resolves elsewhere a moment later (DNS rebinding) gains nothing. Numeric forms (decimal
`2130706433`, hex, octal, IPv4-mapped IPv6) are classified after resolution, so they land in the
same checks. Proxies from the environment are not used: they would resolve the name themselves
(SSL_CERT_FILE / SSL_CERT_DIR still choose the CAs).

The size cap counts decoded bytes: a compressed body is inflated here a bounded piece at a time
(one layer of gzip or deflate; anything else is refused), so a few hundred bytes of nested gzip
cannot become gigabytes before the cap sees them. A whole fetch, redirects included, is under one
clock.

Used by `recursa serve`'s context URLs (recursa.serve.urls) and by the image URLs that sub-calls
name (recursa.lm.images: recursa fetches them and sends the provider the bytes, so no provider
resolves a name that was checked here).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import socket
import ssl
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from recursa.addresses import OWN, IPAddress, address_problem

MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_INFLATE_STEP = 64 * 1024  # most bytes one decompression step may produce
# zlib window bits: a gzip header, or a zlib header (what "deflate" means in HTTP)
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

FetchFailure = Literal["invalid", "refused", "failed", "too_large"]


class FetchError(Exception):
    """A fetch that gave no body: `kind` says why ("invalid": not a URL this fetch takes; "refused":
    a non-public address; "failed": the network or the server; "too_large": past `max_bytes`)."""

    def __init__(self, kind: FetchFailure, message: str) -> None:
        super().__init__(message)
        self.kind: FetchFailure = kind
        self.message = message


@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str  # the media type the server declared, lower case, without parameters ("" if none)


async def fetch_public(
    url: str,
    *,
    what: str,
    max_bytes: int,
    timeout_s: float,
    schemes: tuple[str, ...] = ("http", "https"),
    allow_private: bool = False,
    private_hint: str = "",
    accept: tuple[str, ...] = (),
) -> Fetched:
    """The body at `url` (named `what` in messages), fetched under the rules of the module doc.

    `schemes` holds for every hop; `accept` (media type prefixes such as "image/") refuses any other
    declared Content-Type before the body is read; `private_hint` ends the message of a refused
    address (how the operator may allow it); `allow_private` turns the address check off."""
    current = _parse(url, what, schemes, redirect=False)
    resolver = _Pinned()
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, ssl=tls_context(), limit=4)
    try:
        async with (
            asyncio.timeout(timeout_s),
            aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as session,
        ):
            for hop in range(MAX_REDIRECTS + 1):
                host = current.raw_host or ""
                resolver.pin(
                    host,
                    await _checked(host, current.port or 443, what, allow_private, hop > 0, private_hint),
                )
                headers = {"Accept-Encoding": "gzip, deflate"}
                async with session.get(current, headers=headers, allow_redirects=False) as response:
                    location = response.headers.get("Location")
                    if response.status in _REDIRECTS and location:
                        try:
                            current = _parse(current.join(URL(location)), what, schemes, redirect=True)
                        except ValueError:
                            raise FetchError("failed", f"{what} redirected to an invalid URL") from None
                        continue
                    if response.status >= 300:
                        raise FetchError("failed", f"fetching {what} gave HTTP {response.status}")
                    declared = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
                    if accept and not declared.startswith(accept):
                        raise FetchError(
                            "failed",
                            f"{what} is {declared or 'of no declared type'!r}, not one of {', '.join(accept)}",
                        )
                    body = await read_capped(
                        response.headers.get("Content-Length"),
                        _decoded(
                            response.headers.get("Content-Encoding", ""),
                            response.content.iter_chunked(_CHUNK),
                            what,
                        ),
                        max_bytes,
                        FetchError("too_large", f"{what} is larger than the limit of {max_bytes:,} bytes"),
                    )
                    return Fetched(body, declared)
            raise FetchError("failed", f"{what} redirected more than {MAX_REDIRECTS} times")
    except TimeoutError:
        raise FetchError("failed", f"fetching {what} took longer than {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise FetchError("failed", f"could not fetch {what}: {type(exc).__name__}") from None


class _Pinned(AbstractResolver):
    """The connector's resolver: the addresses checked for each host of this fetch, and nothing else."""

    def __init__(self) -> None:
        self._answers: dict[str, list[IPAddress]] = {}

    def pin(self, host: str, addresses: list[IPAddress]) -> None:
        self._answers[host.rstrip(".").lower()] = addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        addresses = self._answers.get(host.rstrip(".").lower())
        if not addresses:
            raise OSError(f"{host!r} was not checked")
        return [
            {
                "hostname": host,
                "host": str(ip),
                "port": port,
                "family": socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for ip in addresses
        ]

    async def close(self) -> None:
        return None


async def _checked(
    host: str, port: int, what: str, allow_private: bool, redirected: bool, hint: str
) -> list[IPAddress]:
    try:
        addresses = await resolve(host, port)
    except (OSError, UnicodeError):
        addresses = []
    if not addresses:
        raise FetchError("failed", f"could not resolve the host {host!r} of {what}")
    if allow_private:
        return addresses
    for ip in addresses:
        problem = address_problem(ip)
        if problem is not None:
            verb = "redirected to" if redirected else "names"
            article = "one of" if problem == OWN else "an" if problem[0] in "aeiou" else "a"
            kind = f"{article} {problem} address{'es' if problem == OWN else ''}"
            raise FetchError(
                "refused",
                f"{what} {verb} the host {host!r}, which resolves to {kind}; only public addresses are "
                f"fetched{hint}",
            )
    return addresses


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order (numeric forms included)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _parse(url: str | URL, what: str, schemes: tuple[str, ...], *, redirect: bool) -> URL:
    where = f"{what} redirected to a URL that" if redirect else what
    try:
        parsed = URL(url) if isinstance(url, str) else url
    except (ValueError, TypeError):
        raise FetchError("invalid", f"{where} is not a valid URL") from None
    if parsed.scheme not in schemes or not parsed.raw_host:
        spelled = " or ".join(f"{s}://" for s in schemes)
        raise FetchError("invalid", f"{where} must be an {spelled} URL with a host")
    return parsed


async def read_capped(
    declared: str | None, chunks: AsyncIterator[bytes], max_bytes: int, too_large: Exception
) -> bytes:
    """A body (a download, a request's upload) read chunk by chunk, refused (`too_large`) as soon as
    it passes `max_bytes`, so an oversized one never sits whole in memory."""
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


async def _decoded(encoding: str, raw: AsyncIterator[bytes], what: str) -> AsyncIterator[bytes]:
    """The body as sent, inflated in steps of at most _INFLATE_STEP bytes (never all at once), so
    the caller's size cap stops a compression bomb early."""
    layers = [e.strip().lower() for e in encoding.split(",") if e.strip() and e.strip().lower() != "identity"]
    if not layers:
        async for chunk in raw:
            yield chunk
        return
    if len(layers) > 1 or layers[0] not in _ENCODINGS:
        raise FetchError(
            "failed",
            f"the server of {what} sent Content-Encoding {encoding.strip()!r}; only one layer of gzip or "
            "deflate is accepted",
        )
    inflater = zlib.decompressobj(_ENCODINGS[layers[0]])
    try:
        async for chunk in raw:
            # A full step may leave output pending with no input left: ask again until it is short.
            while chunk or not inflater.eof:
                out = inflater.decompress(chunk, _INFLATE_STEP)
                chunk = inflater.unconsumed_tail
                if out:
                    yield out
                if inflater.eof or (not chunk and len(out) < _INFLATE_STEP):
                    break
            if inflater.eof:
                return
    except zlib.error:
        raise FetchError("failed", f"the {layers[0]} body of {what} is corrupt") from None
    raise FetchError("failed", f"the {layers[0]} body of {what} ended before its end")


def tls_context() -> ssl.SSLContext:
    """A client TLS context whose trust store is certifi's bundle (what the provider SDKs use),
    unless SSL_CERT_FILE or SSL_CERT_DIR name another; one per pair of those, made once."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    if cafile is None and capath is None:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:  # no certifi: the system store
            pass
    return ssl.create_default_context(cafile=cafile, capath=capath)
