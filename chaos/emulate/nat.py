"""Devices behind NAT routers, in network namespaces: the homes edge devices live in.

A :class:`NatNetwork` builds, from a :class:`NatLayout`:

- a *WAN* namespace, the internet's core: it routes between everything attached to it;
- one namespace per *public* device, on a subnet of its own (``10.90.I.2/24``, its gateway
  ``10.90.I.1`` in the WAN), reachable from everywhere;
- per *home*, a router namespace (its WAN address ``10.91.K.2``) with a LAN bridge
  (``192.168.K.1/24``) and one namespace per device behind it (``192.168.K.(10+J)``). The
  router masquerades what its devices send out (nftables ``masquerade``) and forwards inbound
  packets only for connections its devices opened (a stateful filter: ``ct state
  established,related``), as a home router does. The WAN routes each home's private subnet to
  its router, so an unsolicited connection to a device behind NAT is silently dropped by the
  router's filter (a timeout, the hard case), rather than refused at once;
- a home with ``blocked=True`` drops even its devices' outbound connections (a firewall that
  lets nothing out).

Names are ``<prefix>-w`` (the WAN), ``<prefix>-<device>`` and ``<prefix>-r<K>`` (routers);
:meth:`NatNetwork.close` deletes every namespace it made, also after a failure part way.
Needs root, iproute2 and ``nft`` (Debian's ``nftables``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

from chaos.emulate.netns import NetworkSetupError, ip_batch, require_root, run_cmd
from chaos.errors import ConfigError

__all__ = ["NatHome", "NatLayout", "NatNetwork", "nft_available", "router_rules"]

COMMAND_TIMEOUT_S = 20.0
"""Timeout of one setup or teardown command."""
MAX_HOMES = 32
MAX_PER_SUBNET = 100


def nft_available() -> bool:
    """Whether the ``nft`` command is installed."""
    return shutil.which("nft") is not None


@dataclass(frozen=True)
class NatHome:
    """One home: devices behind one NAT router.

    Args:
        devices: The device names behind it.
        blocked: The router lets nothing out either (no outbound connection works).
    """

    devices: tuple[str, ...]
    blocked: bool = False


@dataclass(frozen=True)
class NatLayout:
    """Which devices are public and which sit behind which NAT.

    Args:
        public: Devices with a public address, reachable from everywhere.
        homes: The homes, each a NAT router with its devices.

    Raises:
        ConfigError: no device, a name used twice or not a plain name, too many.
    """

    public: tuple[str, ...] = ()
    homes: tuple[NatHome, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [*self.public, *(d for h in self.homes for d in h.devices)]
        if not names:
            raise ConfigError("a NAT layout needs at least one device")
        if len(set(names)) != len(names):
            raise ConfigError(f"a device is named twice: {names}")
        for n in names:
            if not (isinstance(n, str) and n.isalnum() and len(n) <= 8):
                raise ConfigError(f"device names must be alphanumeric, at most 8 chars: {n!r}")
        if len(self.homes) > MAX_HOMES or len(self.public) > MAX_PER_SUBNET:
            raise ConfigError(f"at most {MAX_HOMES} homes and {MAX_PER_SUBNET} public devices")
        if any(not h.devices or len(h.devices) > MAX_PER_SUBNET for h in self.homes):
            raise ConfigError(f"a home holds 1 to {MAX_PER_SUBNET} devices")


def router_rules(wan_if: str, lan_if: str, blocked: bool) -> str:
    """The nftables ruleset of a home router: masquerade out of ``wan_if``, and forward only
    the LAN's outbound connections and their replies (nothing at all when ``blocked``)."""
    out = "" if blocked else f'        iifname "{lan_if}" oifname "{wan_if}" accept\n'
    return (
        "table ip nat {\n"
        "    chain postrouting {\n"
        "        type nat hook postrouting priority 100; policy accept;\n"
        f'        oifname "{wan_if}" masquerade\n'
        "    }\n"
        "}\n"
        "table inet filter {\n"
        "    chain forward {\n"
        "        type filter hook forward priority 0; policy drop;\n"
        "        ct state established,related accept\n"
        f"{out}"
        "    }\n"
        "}\n"
    )


class NatNetwork:
    """The namespaces of a :class:`NatLayout`, built on construction, removed by :meth:`close`.

    Args:
        layout: What to build.
        prefix: Namespace names start with it (unique per run, e.g. ``nat-<pid>``).

    Raises:
        RootRequiredError: not root.
        NetworkSetupError: ``nft`` is missing, or a command failed (what was built is removed).
    """

    def __init__(self, layout: NatLayout, prefix: str) -> None:
        require_root()
        if not nft_available():
            raise NetworkSetupError("nft is not installed (Debian: apt-get install nftables)")
        self.layout = layout
        self.prefix = prefix
        self.namespaces: list[str] = []
        self.addresses: dict[str, str] = {}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, device: str) -> str:
        """The namespace of ``device``."""
        return f"{self.prefix}-{device}"

    def _add_ns(self, name: str) -> str:
        run_cmd(["ip", "netns", "add", name], timeout_s=COMMAND_TIMEOUT_S)
        self.namespaces.append(name)
        ip_batch(name, ["link set lo up"], timeout_s=COMMAND_TIMEOUT_S)
        return name

    def _forwarding(self, ns: str) -> None:
        run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
                timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip

    def _build(self) -> None:
        wan = self._add_ns(f"{self.prefix}-w")
        self._forwarding(wan)
        for i, dev in enumerate(self.layout.public, start=1):
            ns = self._add_ns(self.ns(dev))
            self._veth(wan, f"p{i}", ns, "eth0")
            ip_batch(wan, [f"addr add 10.90.{i}.1/24 dev p{i}", f"link set p{i} up"],
                     timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip
            ip_batch(ns, [f"addr add 10.90.{i}.2/24 dev eth0", "link set eth0 up",
                          f"route add default via 10.90.{i}.1"], timeout_s=COMMAND_TIMEOUT_S)
            self.addresses[dev] = f"10.90.{i}.2"
        for k, home in enumerate(self.layout.homes, start=1):
            self._build_home(wan, k, home)

    def _build_home(self, wan: str, k: int, home: NatHome) -> None:
        router = self._add_ns(f"{self.prefix}-r{k}")
        self._forwarding(router)
        self._veth(wan, f"h{k}", router, "wan0")
        ip_batch(wan, [f"addr add 10.91.{k}.1/24 dev h{k}", f"link set h{k} up",
                       f"route add 192.168.{k}.0/24 via 10.91.{k}.2"],
                 timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip
        ip_batch(router, [f"addr add 10.91.{k}.2/24 dev wan0", "link set wan0 up",
                          f"route add default via 10.91.{k}.1", "link add br0 type bridge",
                          f"addr add 192.168.{k}.1/24 dev br0", "link set br0 up"],
                 timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip
        run_cmd(["ip", "netns", "exec", router, "nft", "-f", "-"],
                stdin=router_rules("wan0", "br0", home.blocked), timeout_s=COMMAND_TIMEOUT_S)
        for j, dev in enumerate(home.devices):
            ns = self._add_ns(self.ns(dev))
            port = f"l{j}"
            self._veth(router, port, ns, "eth0")
            ip_batch(router, [f"link set {port} master br0", f"link set {port} up"],
                     timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip
            addr = f"192.168.{k}.{10 + j}"
            ip_batch(ns, [f"addr add {addr}/24 dev eth0", "link set eth0 up",
                          f"route add default via 192.168.{k}.1"], timeout_s=COMMAND_TIMEOUT_S)
            self.addresses[dev] = addr

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        ip_batch(None, [f"link add {if_a} netns {ns_a} type veth peer name {if_b} netns {ns_b}"],
                 timeout_s=COMMAND_TIMEOUT_S)  # fmt: skip

    def exec_argv(self, device: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``device``'s namespace."""
        return ["ip", "netns", "exec", self.ns(device), *argv]

    def close(self) -> None:
        """Deletes every namespace this network made (their veths go with them)."""
        for name in reversed(self.namespaces):
            run_cmd(["ip", "netns", "del", name], timeout_s=COMMAND_TIMEOUT_S, check=False)
        self.namespaces.clear()

    def __enter__(self) -> NatNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
