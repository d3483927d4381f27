"""Fetching a context URL a client named, without letting the client reach the server's own network.

A server that fetches URLs for its clients stands inside a network they cannot reach: its own
loopback services, the cloud metadata endpoint (169.254.169.254), private and unique-local ranges.
So each hop (the URL, then every redirect) is resolved once, every address the name resolves to
must be public, and the request goes to the address that was checked, with the name in the Host
header and as the TLS server name (certificates are still verified against the name). A name that
resolves to another address a moment later (DNS rebinding) gains nothing: it is never resolved
again for that hop. Numeric forms (decimal `2130706433`, hex, octal, IPv4-mapped IPv6) are
classified after resolution, so they land in the same checks. Proxies from the environment are not
used: they would do their own resolution (SSL_CERT_FILE / SSL_CERT_DIR still choose the CAs).

The size cap counts decoded bytes: a compressed body is inflated here a bounded piece at a time
(one layer of gzip or deflate; anything else is refused), so a few hundred bytes of nested gzip
cannot become gigabytes before the cap sees them.

The server's own addresses are never public, whatever their range: a service bound to 0.0.0.0 on
the server answers on every one of them, a public one included, as it does on loopback.

`allow_private=True` (the operator's `--allow-private-urls`) turns the address check off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import zlib
from collections.abc import AsyncIterator

import httpx

from recursa.addresses import OWN, IPAddress, address_problem
from recursa.serve.api_error import ApiError
from recursa.serve.request import read_capped

MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_PARAM = "recursa.context_url"
_INFLATE_STEP = 64 * 1024  # most bytes one decompression step may produce
# zlib window bits: a gzip header, or a zlib header (what "deflate" means in HTTP)
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

async def fetch_url(url: str, *, max_bytes: int, timeout_s: float, allow_private: bool = False) -> bytes:
    """GET a context over http(s): only public addresses (unless `allow_private`), at most
    MAX_REDIRECTS redirects, each checked like the URL, and no body over `max_bytes`."""
    try:
        async with asyncio.timeout(timeout_s):
            data = await _fetch(_parse(url, redirect=False), max_bytes, timeout_s, allow_private)
    except TimeoutError:
        raise _failed(f"fetching {_PARAM} took longer than {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise _failed(f"could not fetch {_PARAM}: {type(exc).__name__}") from None
    if not data:
        raise ApiError(400, f"{_PARAM} returned an empty body", param=_PARAM)
    return data


async def _fetch(current: httpx.URL, max_bytes: int, timeout_s: float, allow_private: bool) -> bytes:
    # trust_env=False: no proxies (nor .netrc) from the environment; the CA bundle still honours
    # SSL_CERT_FILE / SSL_CERT_DIR, as httpx does by default.
    verify = httpx.create_ssl_context(trust_env=True)
    async with httpx.AsyncClient(
        follow_redirects=False, trust_env=False, timeout=timeout_s, verify=verify
    ) as client:
        for hop in range(MAX_REDIRECTS + 1):
            target, headers, extensions = await _pinned(current, allow_private, redirected=hop > 0)
            headers["Accept-Encoding"] = "gzip, deflate"
            async with client.stream("GET", target, headers=headers, extensions=extensions) as response:
                status = response.status_code
                location = response.headers.get("location")
                if status in _REDIRECTS and location:
                    try:
                        current = _parse(current.join(location), redirect=True)
                    except httpx.InvalidURL:
                        raise _failed(f"{_PARAM} redirected to an invalid URL") from None
                    continue
                if status >= 300:
                    raise _failed(f"fetching {_PARAM} gave HTTP {status}")
                return await read_capped(
                    response.headers.get("content-length"),
                    _decoded(response.headers.get("content-encoding", ""), response.aiter_raw()),
                    max_bytes,
                    ApiError(
                        413,
                        f"the context at {_PARAM} is larger than this server's limit of {max_bytes:,} bytes",
                        param=_PARAM,
                        code="context_too_large",
                    ),
                )
    raise _failed(f"{_PARAM} redirected more than {MAX_REDIRECTS} times")


async def _decoded(encoding: str, raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body as sent, inflated in steps of at most _INFLATE_STEP bytes (never all at once, as
    httpx's own decoders do), so the caller's size cap stops a compression bomb early."""
    layers = [e.strip().lower() for e in encoding.split(",") if e.strip() and e.strip().lower() != "identity"]
    if not layers:
        async for chunk in raw:
            yield chunk
        return
    if len(layers) > 1 or layers[0] not in _ENCODINGS:
        raise _failed(
            f"the server of {_PARAM} sent Content-Encoding {encoding.strip()!r}; "
            "only one layer of gzip or deflate is accepted"
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
        raise _failed(f"the {layers[0]} body of {_PARAM} is corrupt") from None
    raise _failed(f"the {layers[0]} body of {_PARAM} ended before its end")


def _parse(url: str | httpx.URL, *, redirect: bool) -> httpx.URL:
    where = f"{_PARAM} redirected to a URL that" if redirect else _PARAM
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise ApiError(400, f"{where} is not a valid URL", param=_PARAM) from None
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise ApiError(400, f"{where} must be an http:// or https:// URL with a host", param=_PARAM)
    return parsed


async def _pinned(
    url: httpx.URL, allow_private: bool, *, redirected: bool
) -> tuple[httpx.URL, dict[str, str], dict[str, str]]:
    """The URL with its host replaced by the checked address, the Host header, the TLS name."""
    host = url.raw_host.decode("ascii")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses = await resolve(host, port)
    except (OSError, UnicodeError):
        raise _failed(f"could not resolve the host {host!r} of {_PARAM}") from None
    if not addresses:
        raise _failed(f"could not resolve the host {host!r} of {_PARAM}")
    if not allow_private:
        for ip in addresses:
            problem = address_problem(ip)
            if problem is not None:
                verb = "redirected to" if redirected else "names"
                article = "one of" if problem == OWN else "an" if problem[0] in "aeiou" else "a"
                what = f"{article} {problem} address{'es' if problem == OWN else ''}"
                raise ApiError(
                    403,
                    f"{_PARAM} {verb} the host {host!r}, which resolves to {what}; this server "
                    "fetches only public addresses (its operator can allow others with --allow-private-urls)",
                    param=_PARAM,
                    code="context_url_not_allowed",
                )
    extensions = {}
    if url.scheme == "https" and not _is_ip_literal(host):
        extensions["sni_hostname"] = host
    return url.copy_with(host=str(addresses[0])), {"Host": url.netloc.decode("ascii")}, extensions


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order (numeric forms included)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _failed(message: str) -> ApiError:
    return ApiError(400, message, param=_PARAM, code="context_fetch_failed")
