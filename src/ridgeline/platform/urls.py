"""Outbound URL safety: the platform calls URLs that users give it (webhooks, REST tools,
repositories to fetch), so none of those may reach the platform's own network (SSRF).

`check_outbound_url` refuses, with an `UnsafeURLError` (HTTP 400), a URL that is not
http(s), carries credentials, has no host or a bad port, names `localhost`, spells an IPv4
address in a legacy form (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`: refused whatever
they mean, as no client needs them and parsers disagree on them), or whose host is, or
resolves (every address `getaddrinfo` gives) to, a loopback, private (RFC 1918, CGNAT,
fc00::/7), link-local (169.254.0.0/16, fe80::/10), cloud-metadata, unspecified, multicast
or otherwise reserved address. IPv6 forms that carry an IPv4 address (IPv4-mapped,
IPv4-compatible, NAT64, 6to4) are judged by that address. `allow_private=True` (on-prem
deployments, tests on loopback) admits private and loopback targets, never link-local or
metadata ones.

A check before connecting is not enough on its own: DNS may answer differently when the
client resolves the name again (DNS rebinding). The chosen defence is to check the
addresses *at connect time and connect to exactly those*: `SafeTransport` (and
`AsyncSafeTransport`) are httpx transports whose connection pool uses a network backend
that resolves the host once, refuses the connection if any address is unsafe, and opens
the socket to a checked IP. TLS SNI, certificate checks and the Host header still use the
name (httpcore takes them from the URL, not from the socket), so https works unchanged.
Connecting by IP with a hand-set Host header was the alternative; it breaks certificate
checks unless SNI is set by hand too, and every caller would have to repeat it. The
transports also re-check each request URL, so redirects (off by default in
`safe_client`) are checked hop by hop, and they ignore proxy settings from the
environment (a proxy would connect on our behalf, unchecked). The async transport takes
a `resolver` in place of anyio's lookup (the webhook dispatcher runs lookups on its own
threads and counts them against its slots); its answers are checked the same way.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import typing
from collections.abc import Iterable

import anyio
import httpcore
import httpx

from ridgeline.errors import RidgelineError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2048
SCHEMES = ("http", "https")

#: What `allow_private=True` admits; link-local and metadata addresses stay refused.
PRIVATE_CATEGORIES = frozenset({"private", "loopback"})


class UnsafeURLError(RidgelineError):
    """A URL the platform must not call: wrong scheme, credentials, or a host that is or
    resolves to an internal address."""

    code = "unsafe_url"

    def __init__(self, message: str, *, param: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param


class UnresolvableURLError(UnsafeURLError):
    """The URL's host does not resolve, so it cannot be checked (nor called)."""

    code = "unresolvable_url"


# ---- addresses -----------------------------------------------------------------------------

_net = ipaddress.ip_network

# Cloud metadata and host-agent endpoints: refused even when private targets are allowed.
# AWS/GCP/Azure IMDS 169.254.169.254 (link-local anyway), AWS ECS 169.254.170.2, AWS IMDS
# over IPv6 fd00:ec2::254 (in fc00::/7), Alibaba 100.100.100.200 (in CGNAT space), Azure
# wireserver 168.63.129.16 (a public address), Oracle 192.0.0.192.
_METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200",
    "168.63.129.16", "192.0.0.192"))
_METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
# 0.0.0.0/8 is "this network": Linux connects 0.x.x.x to the local host.
_UNSPECIFIED = (_net("0.0.0.0/8"), _net("::/128"))
# RFC 1918, shared (CGNAT) space and unique-local IPv6: reachable inside a deployment only.
_PRIVATE = (_net("10.0.0.0/8"), _net("172.16.0.0/12"), _net("192.168.0.0/16"),
            _net("100.64.0.0/10"), _net("fc00::/7"))
# Where the network itself rewrites an IPv6 address to an IPv4 one (RFC 6052 NAT64 with
# the well-known prefix); the local-use prefix embeds it elsewhere and is refused instead.
_NAT64 = _net("64:ff9b::/96")
_IPV4_COMPATIBLE = _net("::/96")
# Non-global ranges that Python 3.11's `is_global` misses (IETF protocol assignments,
# local-use NAT64).
_RESERVED = (_net("192.0.0.0/24"), _net("64:ff9b:1::/48"))


def _low_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)


def address_category(ip: IPAddress) -> str | None:
    """Why an address is internal ("cloud metadata", "unspecified", "loopback",
    "link-local", "multicast", "private", "reserved"), or None for a public one.
    IPv4-mapped and NAT64 addresses are the IPv4 address they carry; 6to4 and
    IPv4-compatible ones are refused if the address they carry is."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "link-local"
        if ip.ipv4_mapped is not None or ip in _NAT64:
            return address_category(_low_ipv4(ip))
        tunnelled = ip.sixtofour or (_low_ipv4(ip) if ip in _IPV4_COMPATIBLE and int(ip) > 1
                                     else None)
        if tunnelled is not None and (category := address_category(tunnelled)) is not None:
            return category
    if ip in _METADATA:
        return "cloud metadata"
    if any(ip in n for n in _UNSPECIFIED):
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if any(ip in n for n in _PRIVATE):
        return "private"
    if ip.is_reserved or ip.is_private or not ip.is_global or any(ip in n for n in _RESERVED):
        return "reserved"
    return None


def _refuse_address(ip: IPAddress, allow_private: bool, subject: str) -> None:
    """Raise if the address is not allowed; `subject` starts the message ("host x is")."""
    category = address_category(ip)
    if category is None or (allow_private and category in PRIVATE_CATEGORIES):
        return
    hint = ("the platform only calls public addresses; on-prem deployments may allow "
            "private ones with allow_private_targets" if category in PRIVATE_CATEGORIES
            else "the platform never calls link-local, metadata or reserved addresses")
    article = "an" if category[0] in "aeiou" else "a"
    raise UnsafeURLError(f"{subject} {article} {category} address", param="url", hint=hint)


# ---- hosts ---------------------------------------------------------------------------------

_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


def _legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The address `inet_aton` (and so `getaddrinfo`) reads from an all-numeric host:
    1 to 4 parts, each decimal, octal (leading 0) or hex (0x), the last filling the rest.
    None if the host is not all-numeric; `UnsafeURLError` if it is but is malformed."""
    labels = host.split(".")
    if not 1 <= len(labels) <= 4 or not all(_NUMERIC_LABEL.match(p) for p in labels):
        return None
    try:
        parts = [int(p, 16) if p.startswith("0x") else int(p, 8) if len(p) > 1 and
                 p.startswith("0") else int(p) for p in labels]
    except ValueError:
        raise UnsafeURLError(f"host {host!r} is not a valid IPv4 address", param="url",
                             hint="write it as a.b.c.d") from None
    *head, last = parts
    last_bits = 8 * (5 - len(parts))
    if any(p > 0xFF for p in head) or last >= 1 << last_bits:
        raise UnsafeURLError(f"host {host!r} is not a valid IPv4 address", param="url",
                             hint="write it as a.b.c.d")
    value = last
    for i, p in enumerate(head):
        value |= p << (24 - 8 * i)
    return ipaddress.IPv4Address(value)


def _host_address(host: str, allow_private: bool) -> IPAddress | None:
    """Check a URL's host (ASCII, lowercase, no brackets) on its own, before any lookup;
    the address it spells, or None for a name."""
    name = host[:-1] if host.endswith(".") else host
    if not name:
        raise UnsafeURLError("the URL has no host", param="url")
    if ":" in name:  # an IPv6 literal
        if "%" in name:
            raise UnsafeURLError(f"host [{host}] has a zone id (a link-local address)",
                                 param="url", hint="use a public address or a name")
        try:
            ip6 = ipaddress.IPv6Address(name)
        except ValueError:
            raise UnsafeURLError(f"host [{host}] is not a valid IPv6 address",
                                 param="url") from None
        _refuse_address(ip6, allow_private, f"host [{host}] is" if name == str(ip6)
                        else f"host [{host}] means {ip6},")
        return ip6
    ip4 = _legacy_ipv4(name)
    if ip4 is not None:
        _refuse_address(ip4, allow_private, f"host {host} is" if name == str(ip4)
                        else f"host {host!r} means {ip4},")
        if name != str(ip4):
            raise UnsafeURLError(f"host {host!r} spells the IPv4 address {ip4} in a legacy "
                                 "form", param="url", hint=f"write it as {ip4}")
        return ip4
    if name in _METADATA_NAMES:
        raise UnsafeURLError(f"host {host!r} is a cloud metadata endpoint", param="url")
    if (name == "localhost" or name.endswith(".localhost")) and not allow_private:
        raise UnsafeURLError(f"host {host!r} is the local machine", param="url",
                             hint="the platform only calls public hosts")
    return None


def resolve_host(host: str, port: int, *, allow_private: bool = False) -> list[str]:
    """Every address `host` resolves to, each checked; the addresses to connect to.
    Raises `UnsafeURLError` if any is unsafe, `UnresolvableURLError` if there are none."""
    literal = _host_address(host, allow_private)
    if literal is not None:
        return [str(literal)]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UnresolvableURLError(f"host {host!r} does not resolve ({e})", param="url",
                                   hint="check the host name") from None
    return _checked_addresses(host, infos, allow_private)


def _checked_addresses(host: str, infos: Iterable[tuple[typing.Any, ...]],
                       allow_private: bool) -> list[str]:
    addresses: list[str] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if family == socket.AF_INET6 and len(sockaddr) >= 4 and sockaddr[3]:
            ip = ipaddress.IPv6Address(f"{ip}%{sockaddr[3]}")   # keep the scope: link-local
        _refuse_address(ip, allow_private, f"host {host!r} resolves to {ip},")
        if str(ip) not in addresses:
            addresses.append(str(ip))
    if not addresses:
        raise UnresolvableURLError(f"host {host!r} has no IPv4 or IPv6 address",
                                   param="url")
    return addresses


def check_outbound_url(url: str, *, allow_private: bool = False, resolve: bool = True) -> str:
    """The URL, normalised, if the platform may call it; else `UnsafeURLError`.

    `resolve=False` checks only what the URL says (for a check without DNS); the
    transports below check the resolved addresses again when they connect."""
    if not isinstance(url, str) or not url.strip():
        raise UnsafeURLError("the URL is empty", param="url")
    if len(url) > MAX_URL_LENGTH:
        raise UnsafeURLError(f"the URL is longer than {MAX_URL_LENGTH} characters",
                             param="url")
    try:
        parsed = httpx.URL(url.strip())   # the parser the platform's client uses
    except (httpx.InvalidURL, ValueError) as e:
        raise UnsafeURLError(f"invalid URL: {e}", param="url") from None
    if parsed.scheme not in SCHEMES:
        raise UnsafeURLError(f"URL scheme {parsed.scheme or '(none)'!r} is not allowed",
                             param="url", hint="use an http:// or https:// URL")
    if parsed.userinfo:
        raise UnsafeURLError("the URL carries credentials (user:password@)", param="url",
                             hint="pass secrets in headers or the platform's secret store")
    host = parsed.raw_host.decode("ascii").lower()
    port = parsed.port
    if port is not None and not 1 <= port <= 65535:
        raise UnsafeURLError(f"URL port {port} is out of range", param="url")
    if resolve:
        resolve_host(host, port or (443 if parsed.scheme == "https" else 80),
                     allow_private=allow_private)
    else:
        _host_address(host, allow_private)
    return str(parsed)


# ---- transports that connect to the addresses they checked ---------------------------------


class _PinnedBackend(httpcore.NetworkBackend):
    """Resolves once, checks every address, connects to a checked one."""

    def __init__(self, allow_private: bool) -> None:
        self._allow_private = allow_private
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[typing.Any] | None = None
                    ) -> httpcore.NetworkStream:
        try:
            addresses = resolve_host(host, port, allow_private=self._allow_private)
        except UnresolvableURLError as e:   # DNS trouble may pass: a connection error
            raise httpcore.ConnectError(str(e)) from None
        last: Exception | None = None
        for ip in addresses:
            try:
                return self._inner.connect_tcp(ip, port, timeout, local_address,
                                               socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        assert last is not None
        raise last

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[typing.Any] | None = None
                            ) -> httpcore.NetworkStream:
        raise UnsafeURLError("unix sockets are not outbound targets")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


#: An async `getaddrinfo(host, port)`: `socket.getaddrinfo`'s answer for a TCP connection.
AsyncResolver = typing.Callable[[str, int], typing.Awaitable[list[tuple[typing.Any, ...]]]]


async def _anyio_resolver(host: str, port: int) -> list[tuple[typing.Any, ...]]:
    return await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)


class _AsyncPinnedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, allow_private: bool, resolver: AsyncResolver | None = None) -> None:
        self._allow_private = allow_private
        self._resolver = resolver or _anyio_resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[typing.Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        literal = _host_address(host, self._allow_private)
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                infos = await self._resolver(host, port)
            except (socket.gaierror, UnicodeError) as e:
                raise httpcore.ConnectError(f"host {host!r} does not resolve ({e})") from None
            try:
                addresses = _checked_addresses(host, infos, self._allow_private)
            except UnresolvableURLError as e:
                raise httpcore.ConnectError(str(e)) from None
        last: Exception | None = None
        for ip in addresses:
            try:
                return await self._inner.connect_tcp(ip, port, timeout, local_address,
                                                     socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        assert last is not None
        raise last

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[typing.Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise UnsafeURLError("unix sockets are not outbound targets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _pool_kwargs(verify: ssl.SSLContext | str | bool,
                 limits: httpx.Limits) -> dict[str, typing.Any]:
    return dict(ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry)


class SafeTransport(httpx.HTTPTransport):
    """An httpx transport that calls only safe URLs and connects only to checked
    addresses (see the module docstring). No proxies, no unix sockets."""

    def __init__(self, *, allow_private: bool = False,
                 verify: ssl.SSLContext | str | bool = True,
                 limits: httpx.Limits = httpx.Limits(max_connections=100,
                                                     max_keepalive_connections=20)) -> None:
        super().__init__(verify=verify, trust_env=False, limits=limits)
        self.allow_private = allow_private
        # httpx builds its pool without a network-backend hook; this one has ours.
        self._pool = httpcore.ConnectionPool(network_backend=_PinnedBackend(allow_private),
                                             **_pool_kwargs(verify, limits))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        check_outbound_url(str(request.url), allow_private=self.allow_private, resolve=False)
        return super().handle_request(request)


class AsyncSafeTransport(httpx.AsyncHTTPTransport):
    """The asyncio/trio twin of `SafeTransport`. `resolver` replaces the host lookup (by
    default anyio's `getaddrinfo` on a worker thread); its answer is checked the same way."""

    def __init__(self, *, allow_private: bool = False,
                 verify: ssl.SSLContext | str | bool = True,
                 limits: httpx.Limits = httpx.Limits(max_connections=100,
                                                     max_keepalive_connections=20),
                 resolver: AsyncResolver | None = None) -> None:
        super().__init__(verify=verify, trust_env=False, limits=limits)
        self.allow_private = allow_private
        self._pool = httpcore.AsyncConnectionPool(
            network_backend=_AsyncPinnedBackend(allow_private, resolver),
            **_pool_kwargs(verify, limits))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        check_outbound_url(str(request.url), allow_private=self.allow_private, resolve=False)
        return await super().handle_async_request(request)


def safe_client(*, allow_private: bool = False, timeout: float = 10.0,
                **kwargs: typing.Any) -> httpx.Client:
    """An `httpx.Client` over `SafeTransport`; redirects off, environment proxies ignored."""
    kwargs.setdefault("follow_redirects", False)
    return httpx.Client(transport=SafeTransport(allow_private=allow_private),
                        timeout=timeout, trust_env=False, **kwargs)


def safe_async_client(*, allow_private: bool = False, timeout: float = 10.0,
                      resolver: AsyncResolver | None = None,
                      limits: httpx.Limits | None = None,
                      **kwargs: typing.Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` over `AsyncSafeTransport`."""
    kwargs.setdefault("follow_redirects", False)
    transport = AsyncSafeTransport(allow_private=allow_private, resolver=resolver,
                                   **({"limits": limits} if limits is not None else {}))
    return httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False, **kwargs)
