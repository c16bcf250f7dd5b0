"""Where a model judge may send requests: public addresses only, unless a deployment allows more.

A reward spec's `judge.base_url` is typed by a person with access to the spec, and the worker that
calls it sits inside the deployment's network: unchecked, the judge is a way to make the worker
request internal services (the database's admin port, a cloud metadata endpoint) and read their
answers back. So the host is resolved for every request and *every* address it resolves to must
be global (not private, loopback, link-local, CGNAT, multicast, reserved or unspecified; IPv4
inside IPv6 is unwrapped), or inside `FLYWHEEL_JUDGE_ALLOWED_NETWORKS`. The connection then goes
to the address that was checked (the Host header and TLS name stay the URL's), so a second DNS
answer cannot swap in another. Redirects are not followed; a response over `MAX_RESPONSE_BYTES`
is refused without reading the rest.

    .venv/bin/python -m pytest tests/training/rewards/test_judge_endpoint.py -q
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

MAX_RESPONSE_BYTES = 1 << 20
ALLOWED_NETWORKS_ENV = "FLYWHEEL_JUDGE_ALLOWED_NETWORKS"
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class JudgeURLRefused(ValueError):
    """The judge's URL, or an address its host resolves to, is not one a judge may reach."""


def configured_networks() -> tuple[str, ...]:
    """`FLYWHEEL_JUDGE_ALLOWED_NETWORKS`: comma-separated CIDRs. Read here, not through Django's
    settings: judges are used by the pure reward and gate code, which imports no Django."""
    raw = os.environ.get(ALLOWED_NETWORKS_ENV, "")
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def parse_networks(networks: Sequence[str]) -> tuple[Network, ...]:
    try:
        return tuple(ipaddress.ip_network(n, strict=False) for n in networks)
    except ValueError as exc:
        raise JudgeURLRefused(f"FLYWHEEL_JUDGE_ALLOWED_NETWORKS has {exc}: give CIDRs such as 10.0.0.0/8") from None


def url_check(url: str, networks: Sequence[Network]) -> None:
    """What can be checked without resolving: http(s), a host, no credentials in the URL, and a
    literal address that is allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JudgeURLRefused(f"judge base_url {url[:200]!r} is not an http(s) URL with a host: "
                              "give e.g. https://judge.example.com/v1")
    if parts.username is not None or parts.password is not None:
        raise JudgeURLRefused("judge base_url carries credentials: give the key as api_key instead")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return
    _address_check(parts.hostname, address, networks)


def resolve_checked(host: str, port: int, networks: Sequence[Network]) -> list[str]:
    """Every address `host` resolves to, each allowed; else JudgeURLRefused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise JudgeURLRefused(f"the judge host {host[:200]!r} does not resolve ({exc})") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for text in addresses:
        _address_check(host, ipaddress.ip_address(text.split("%", 1)[0]), networks)
    if not addresses:
        raise JudgeURLRefused(f"the judge host {host[:200]!r} resolves to no address")
    return addresses


def _address_check(host: str, address: Address, networks: Sequence[Network]) -> None:
    inner = _embedded_ipv4(address)
    if any(inner in net for net in networks if net.version == inner.version):
        return
    if not inner.is_global or inner.is_multicast:
        raise JudgeURLRefused(
            f"the judge host {host[:200]!r} is {inner}, not a public address (private, loopback, link-local "
            "and metadata ranges are refused): use a public endpoint, or allow the network with "
            "FLYWHEEL_JUDGE_ALLOWED_NETWORKS")


def _embedded_ipv4(address: Address) -> Address:
    """The IPv4 address inside an IPv4-mapped, 6to4, Teredo or NAT64 one (what is really reached)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address.teredo is not None:
            return address.teredo[1]
        if address in ipaddress.ip_network("64:ff9b::/96"):
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


class GuardedTransport(httpx.BaseTransport):
    """Checks every request's host (all its addresses) and connects to the checked address."""

    def __init__(self, networks: Sequence[Network], inner: httpx.BaseTransport | None = None) -> None:
        self.networks, self.inner = tuple(networks), inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        address = resolve_checked(host, port, self.networks)[0]
        if address != host:
            request.extensions = {**request.extensions, "sni_hostname": host}
            request.url = request.url.copy_with(host=address)  # the Host header keeps the name
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def read_capped(response: httpx.Response, limit: int = MAX_RESPONSE_BYTES) -> bytes | None:
    """The body of a streamed response, or None once it passes `limit` (the rest is never read)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
