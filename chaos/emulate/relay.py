"""The latency relay: a TUN device that hands every packet back to the kernel ``delay_s`` later.

Used where the kernel has no ``netem`` qdisc (as here). One relay runs in each emulated device's
namespace, attached to a persistent TUN device (``dly``). The routing set up by
:class:`chaos.emulate.network.Network` sends every packet that *leaves* the device towards another
device's node address into ``dly``; the relay reads it, holds it for ``delay_s`` and writes it back
into ``dly``. The kernel then sees it arrive on ``dly`` and a policy rule (``iif dly lookup
<table>``) forwards it out of the real veth towards the next hop. Each hop thus adds ``delay_s`` of
one-way delay, as on a real multi-hop path, and everything above IP (TCP, the daemons) is unchanged.

Why TUN rather than a TCP/UDP proxy: a proxy would change addresses and ports, break multi-hop
routing and need to know every service; at the IP layer the relay is transparent to any traffic.

Why Python: it is small and has no build step. Its packet rate is its limit: it handles MTU-sized
packets (the kernel segments before a plain TUN device), so its ceiling in Mbit/s is about the
packets per second Python can read and write. ``chaos-emulate relay-bench`` measures it; see
``docs/emulation.md`` for the figures on this machine.

Run as ``python -m chaos.emulate.relay --dev dly --delay-s 0.02`` inside the namespace; it prints
``ready`` once attached and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_BATCH = 512  # packets read per wake-up; larger batches cost delay accuracy under load
MAX_PACKET = 65536


def open_tun(name: str) -> int:
    """Attaches to the (persistent) TUN device ``name`` and returns its non-blocking fd.

    Raises:
        OSError: ``/dev/net/tun`` is missing, or the device cannot be attached (not root, name in
            use by another reader, or not a TUN device).
    """
    if not name or len(name) > 15:
        raise ValueError(f"bad TUN device name {name!r}: 1 to 15 characters")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def relay(fd: int, delay_s: float, stop: list[bool]) -> None:
    """Delays every packet read from ``fd`` by ``delay_s`` and writes it back, until ``stop[0]``.

    Packets keep their order. A packet the kernel refuses on write is dropped (as a lossy link
    would).

    Args:
        fd: A TUN device's non-blocking file descriptor.
        delay_s: The one-way delay added to every packet, seconds.
        stop: A one-element flag list; the loop ends within 0.2 s of ``stop[0]`` becoming true.
    """
    queue: deque[tuple[float, bytes]] = deque()
    read = os.read
    write = os.write
    now = time.monotonic
    while not stop[0]:
        wait_s = max(0.0, queue[0][0] - now()) if queue else 0.2
        readable, _, _ = select.select([fd], [], [], wait_s)
        if readable:
            due = now() + delay_s
            for _ in range(READ_BATCH):
                try:
                    queue.append((due, read(fd, MAX_PACKET)))
                except BlockingIOError:
                    break
        t = now()
        while queue and queue[0][0] <= t:
            try:
                write(fd, queue.popleft()[1])
            except OSError:
                pass  # refused by the kernel: dropped, like on a lossy link


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m chaos.emulate.relay --dev NAME --delay-s SECONDS``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dev", required=True, help="persistent TUN device to attach to")
    parser.add_argument("--delay-s", type=float, required=True, help="one-way delay, seconds")
    args = parser.parse_args(argv)
    if not 0.0 <= args.delay_s <= 10.0:
        parser.error(f"--delay-s must be within [0, 10] seconds, got {args.delay_s}")
    stop = [False]

    def _stop(_sig: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        fd = open_tun(args.dev)
    except (OSError, ValueError) as e:
        print(f"error: cannot attach to TUN device {args.dev!r}: {e}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    try:
        relay(fd, args.delay_s, stop)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
