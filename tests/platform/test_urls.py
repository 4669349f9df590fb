"""Outbound URL safety: the refusals (schemes, credentials, internal addresses in every
spelling), the private-targets switch that never opens link-local or metadata, and the
transports that connect only to the address they checked (a DNS answer that changes
between check and connect is caught), against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ridgeline.errors import RidgelineError
from ridgeline.platform.urls import (
    UnresolvableURLError, UnsafeURLError, address_category, check_outbound_url, resolve_host,
    safe_async_client, safe_client,
)
from ridgeline.wire import error_for

# (url, words the refusal must contain): refused whatever allow_private says.
ALWAYS_REFUSED = [
    ("file:///etc/passwd", "scheme 'file'"),
    ("gopher://x", "scheme 'gopher'"),
    ("ftp://example.com/f", "scheme 'ftp'"),
    ("javascript:alert(1)", "scheme 'javascript'"),
    ("http://user:pw@example.com/", "credentials"),
    ("http://evil.com\\@127.0.0.1/", "credentials"),
    ("http:///path", "no host"),
    ("", "empty"),
    ("http://example.com:0/", "port 0"),
    ("http://example.com:99999/", "port 99999"),
    ("http://169.254.169.254/latest/meta-data", "cloud metadata"),
    ("http://169.254.10.1/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[fe80::1%25eth0]/", "zone id"),
    ("http://[::ffff:169.254.169.254]/", "cloud metadata"),
    ("http://[64:ff9b::a9fe:a9fe]/", "cloud metadata"),   # NAT64 of the metadata address
    ("http://[fd00:ec2::254]/", "cloud metadata"),         # AWS IMDS over IPv6, inside fc00::/7
    ("http://100.100.100.200/", "cloud metadata"),         # Alibaba, inside CGNAT space
    ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://0.1.2.3/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://224.0.0.1/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://240.0.0.1/", "reserved"),
    ("http://255.255.255.255/", "reserved"),
    ("http://192.0.2.1/", "reserved"),                    # documentation range
    # legacy IPv4 spellings: refused whatever they mean, loopback or public
    ("http://2130706433/", "127.0.0.1"),
    ("http://0x7f000001/", "127.0.0.1"),
    ("http://0x7f.1/", "127.0.0.1"),
    ("http://127.1/", "127.0.0.1"),
    ("http://0x08080808/", "8.8.8.8"),
    ("http://0177.0.0.1/", "invalid"),
    ("http://1.2.3.256/", "invalid"),
]

# Refused by default, admitted with allow_private=True.
PRIVATE = [
    ("http://127.0.0.1:8080/hook", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://localhost/", "local machine"),
    ("http://LocalHost./", "local machine"),
    ("http://api.localhost/", "local machine"),
    ("http://10.1.2.3/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://100.64.0.1/", "private"),
    ("http://[fd12:3456::1]/", "private"),
]


@pytest.mark.parametrize("url,words", ALWAYS_REFUSED)
@pytest.mark.parametrize("allow_private", [False, True])
def test_refused_whatever_the_private_switch_says(url: str, words: str,
                                                  allow_private: bool) -> None:
    for resolve in (False, True):
        with pytest.raises(UnsafeURLError) as info:
            check_outbound_url(url, allow_private=allow_private, resolve=resolve)
        assert words in str(info.value)


@pytest.mark.parametrize("url,words", PRIVATE)
def test_private_targets_need_the_switch(url: str, words: str) -> None:
    with pytest.raises(UnsafeURLError) as info:
        check_outbound_url(url, resolve=False)
    assert words in str(info.value)
    assert "allow_private_targets" in str(info.value) or words == "local machine"
    assert check_outbound_url(url, allow_private=True, resolve=False).startswith("http://")


def test_public_urls_pass_and_come_back_normalised() -> None:
    assert check_outbound_url("HTTP://Example.COM/a?b=1", resolve=False) == \
        "http://example.com/a?b=1"
    assert check_outbound_url("https://8.8.8.8/x") == "https://8.8.8.8/x"
    assert check_outbound_url("https://[2606:4700::1111]:8443/") == \
        "https://[2606:4700::1111]:8443/"
    # an IPv4-mapped or NAT64 public address is that public address
    assert check_outbound_url("http://[::ffff:8.8.8.8]/", resolve=False)
    assert check_outbound_url("http://[64:ff9b::808:808]/", resolve=False)


def test_address_categories() -> None:
    def cat(a: str) -> str | None:
        return address_category(ipaddress.ip_address(a))

    assert cat("8.8.8.8") is None and cat("2606:4700::1111") is None
    assert cat("127.0.0.5") == "loopback" and cat("::1") == "loopback"
    assert cat("169.254.169.254") == "cloud metadata" and cat("169.254.1.1") == "link-local"
    assert cat("168.63.129.16") == "cloud metadata"      # a public address, still refused
    assert cat("172.31.255.255") == "private" and cat("172.32.0.1") is None
    assert cat("::ffff:10.0.0.1") == "private"
    assert cat("::7f00:1") == "loopback"                 # IPv4-compatible
    assert cat("2002:a9fe:a9fe::1") == "cloud metadata"  # 6to4 around the metadata address
    assert cat("2002:808:808::1") is None                # 6to4 around a public one
    assert cat("2001:db8::1") == "reserved"


def test_unsafe_url_is_a_400_with_an_openai_error_body() -> None:
    with pytest.raises(UnsafeURLError) as info:
        check_outbound_url("http://169.254.169.254/latest/meta-data")
    assert isinstance(info.value, RidgelineError)
    status, body = error_for(info.value)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "url" and body["error"]["code"] == "unsafe_url"
    assert "metadata" in body["error"]["message"]


def test_a_name_that_does_not_resolve_is_refused() -> None:
    with pytest.raises(UnresolvableURLError, match="does not resolve"):
        check_outbound_url("https://no-such-host.invalid/hook")
    # without resolution only the URL itself is judged
    assert check_outbound_url("https://no-such-host.invalid/hook", resolve=False)


def test_a_name_resolving_to_this_machine_is_refused() -> None:
    """The machine's own host name (no monkeypatching: the real resolver) resolves to
    loopback or a private address on practically every host."""
    name = socket.gethostname()
    try:
        addrs = {i[4][0].split("%")[0] for i in socket.getaddrinfo(name, 80,
                                                                   type=socket.SOCK_STREAM)}
    except socket.gaierror:
        pytest.skip(f"host name {name!r} does not resolve here")
    if not all(ipaddress.ip_address(a).is_private for a in addrs):
        pytest.skip(f"host name {name!r} resolves to a public address here: {addrs}")
    with pytest.raises(UnsafeURLError, match="resolves to"):
        check_outbound_url(f"http://{name}:8080/hook")
    assert check_outbound_url(f"http://{name}:8080/hook", resolve=False)  # the name alone is fine


# ---- the transports, against a real server and a resolver that changes its answer ------------


class _Recorder(BaseHTTPRequestHandler):
    hits: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.hits.append((self.path, self.headers.get("host", "")))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("location", "http://169.254.169.254/latest/meta-data")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        body = b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, list[tuple[str, str]]]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1], _Recorder.hits
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def hits(server: tuple[int, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    server[1].clear()
    return server[1]


@pytest.fixture
def port(server: tuple[int, list[tuple[str, str]]]) -> int:
    return server[0]


@pytest.fixture
def attacker_dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[str]]]:
    """A resolver whose answers for some names change from one lookup to the next, as a
    DNS-rebinding attacker's does (the last answer repeats). Other names resolve for real."""
    answers: dict[str, list[list[str]]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: str | bytes | None, port: object, *args: object,
                    **kwargs: object) -> list[tuple[object, ...]]:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in answers:
            return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
        seq = answers[name]
        ips = seq.pop(0) if len(seq) > 1 else seq[0]
        p = int(port) if port is not None else 0  # type: ignore[call-overload]
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, p, 0, 0)) if ":" in ip
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in ips]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


def test_every_resolved_address_is_checked(attacker_dns: dict[str, list[list[str]]]) -> None:
    attacker_dns["mixed.example"] = [["93.184.215.14", "10.0.0.7"]]
    with pytest.raises(UnsafeURLError, match="resolves to 10.0.0.7, a private address"):
        check_outbound_url("https://mixed.example/")
    attacker_dns["meta.example"] = [["169.254.169.254"]]
    with pytest.raises(UnsafeURLError, match="cloud metadata"):
        check_outbound_url("https://meta.example/", allow_private=True)
    attacker_dns["public.example"] = [["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"]]
    assert resolve_host("public.example", 443) == ["93.184.215.14",
                                                   "2606:2800:21f:cb07:6820:80da:af6b:8b2c"]


def test_safe_client_calls_loopback_only_when_allowed(port: int, hits: list) -> None:
    with safe_client(allow_private=True) as client:
        assert client.get(f"http://127.0.0.1:{port}/ok").text == "ok"
    assert [p for p, _ in hits] == ["/ok"]
    with safe_client() as client:
        for url in (f"http://127.0.0.1:{port}/no", f"http://localhost:{port}/no",
                    f"http://2130706433:{port}/no"):
            with pytest.raises(UnsafeURLError):
                client.get(url)
    assert [p for p, _ in hits] == ["/ok"]   # nothing reached the server


def test_dns_rebinding_between_check_and_connect_is_caught(
        port: int, hits: list, attacker_dns: dict[str, list[list[str]]]) -> None:
    url = f"http://rebind.example:{port}/secret"
    attacker_dns["rebind.example"] = [["93.184.215.14"], ["127.0.0.1"]]
    assert check_outbound_url(url) == url          # the first answer is public
    # An ordinary client resolves again and reaches the internal server: the attack.
    with httpx.Client(trust_env=False) as plain:
        assert plain.get(url).status_code == 200
    assert [p for p, _ in hits] == ["/secret"]
    hits.clear()
    attacker_dns["rebind.example"] = [["93.184.215.14"], ["127.0.0.1"]]
    assert check_outbound_url(url) == url
    with safe_client() as client, pytest.raises(UnsafeURLError, match="127.0.0.1"):
        client.get(url)
    assert hits == []


def test_the_pinned_connection_keeps_the_name_in_the_host_header(
        port: int, hits: list, attacker_dns: dict[str, list[list[str]]]) -> None:
    attacker_dns["internal.example"] = [["127.0.0.1"]]
    with safe_client(allow_private=True) as client:
        assert client.get(f"http://internal.example:{port}/named").status_code == 200
    assert hits == [("/named", f"internal.example:{port}")]


def test_redirects_are_not_followed_and_each_hop_is_checked(port: int, hits: list) -> None:
    with safe_client(allow_private=True) as client:
        assert client.get(f"http://127.0.0.1:{port}/redirect").status_code == 302
    with safe_client(allow_private=True, follow_redirects=True) as client:
        with pytest.raises(UnsafeURLError, match="cloud metadata"):
            client.get(f"http://127.0.0.1:{port}/redirect")
    assert [p for p, _ in hits] == ["/redirect", "/redirect"]


def test_the_async_transport_checks_the_same_way(
        port: int, hits: list, attacker_dns: dict[str, list[list[str]]]) -> None:
    async def main() -> None:
        async with safe_async_client(allow_private=True) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/async")).text == "ok"
        async with safe_async_client() as client:
            with pytest.raises(UnsafeURLError):
                await client.get(f"http://[::1]:{port}/no")
            attacker_dns["rebind.example"] = [["127.0.0.1"]]
            with pytest.raises(UnsafeURLError, match="resolves to 127.0.0.1"):
                await client.get(f"http://rebind.example:{port}/no")
        async with safe_async_client(allow_private=True) as client:
            attacker_dns["meta.example"] = [["169.254.169.254"]]
            with pytest.raises(UnsafeURLError, match="cloud metadata"):
                await client.get(f"http://meta.example:{port}/no")

    asyncio.run(main())
    assert [p for p, _ in hits] == ["/async"]


def test_an_injected_resolver_is_used_and_its_answers_are_checked(port: int, hits: list) -> None:
    """The async transport's `resolver` replaces the lookup (the webhook dispatcher's own
    DNS threads); what it answers is checked like the system resolver's."""
    answers = {"ok.example": "127.0.0.1", "meta.example": "169.254.169.254"}
    asked: list[str] = []

    async def resolver(host: str, p: int) -> list[tuple[object, ...]]:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], p))]

    async def main() -> None:
        async with safe_async_client(allow_private=True, resolver=resolver) as client:
            assert (await client.get(f"http://ok.example:{port}/injected")).text == "ok"
            with pytest.raises(UnsafeURLError, match="cloud metadata"):
                await client.get(f"http://meta.example:{port}/no")

    asyncio.run(main())
    assert asked == ["ok.example", "meta.example"]   # neither name exists in real DNS
    assert hits == [("/injected", f"ok.example:{port}")]
