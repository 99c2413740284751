"""In-process probes of the emulated network: TCP bulk throughput and UDP ping-pong latency.

Both ends are sockets of *this* process, created inside the two namespaces with
:func:`chaos.emulate.netns.netns_socket`, so no iperf3 or ping is needed.

Throughput is reported two ways: ``goodput_bps`` (TCP payload bytes per second seen by the
receiver) and ``wire_bps`` (goodput scaled to whole Ethernet frames, ``(mtu + 14) / mss``), which is
what tbf meters and so what a link's setting is compared with.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

from chaos.emulate.netns import netns_socket
from chaos.errors import ChaosTimeout

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
ETH_HEADER = 14
CHUNK = 64 * 1024
TCP_INFO_LEN = 256
TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)


@dataclass(frozen=True)
class BulkResult:
    """One bulk transfer's figures.

    Attributes:
        goodput_bps: TCP payload bits per second over the measuring window.
        wire_bps: ``goodput_bps`` counted as Ethernet frames (what tbf shapes).
        mss: The connection's maximum segment size, bytes.
        window_s: The measuring window, seconds.
        window_bytes: Payload bytes received in the window.
    """

    goodput_bps: float
    wire_bps: float
    mss: int
    window_s: float
    window_bytes: int


def bulk_transfer(
    src_ns: str,
    dst_ns: str,
    dst_addr: str,
    *,
    duration_s: float = 1.5,
    warmup_s: float = 0.5,
    timeout_s: float = 10.0,
    pacing_bps: float | None = None,
    mtu: int = 1500,
) -> BulkResult:
    """Sends TCP data from ``src_ns`` to ``dst_addr`` in ``dst_ns`` and measures the rate.

    The receiver ignores the first ``warmup_s`` (slow start, the tbf bucket's initial burst) and
    counts the next ``duration_s``.

    Args:
        src_ns: Sender's namespace.
        dst_ns: Receiver's namespace.
        dst_addr: Address the receiver binds to (in ``dst_ns``).
        duration_s: Measuring window. Longer windows average out CPU noise.
        warmup_s: Time ignored before the window.
        timeout_s: Timeout of every blocking socket call.
        pacing_bps: Cap the sender's rate (kernel TCP pacing, frames counted) - used to offer a
            fixed load; ``None``: as fast as the path allows.
        mtu: The path's MTU, for ``wire_bps``.

    Returns:
        The transfer's figures.

    Raises:
        ChaosTimeout: no data flowed for ``timeout_s``, or the transfer did not finish in
            ``warmup_s + duration_s + timeout_s``.
        OSError: a socket error other than a timeout (e.g. unreachable).
    """
    if duration_s <= 0 or warmup_s < 0 or timeout_s <= 0:
        raise ValueError("duration_s and timeout_s must be positive, warmup_s non-negative")
    srv = netns_socket(dst_ns)
    cli = netns_socket(src_ns)
    done = threading.Event()
    try:
        conn = _open_connection(srv, cli, dst_addr, timeout_s, pacing_bps)
        window_bytes, window_s, mss = _run_window(conn, cli, done, warmup_s, duration_s, timeout_s)
    except TimeoutError as e:
        msg = f"bulk transfer {src_ns} -> {dst_addr}: no progress in {timeout_s} s"
        raise ChaosTimeout(msg) from e
    finally:
        done.set()
        cli.close()
        srv.close()
    goodput = window_bytes * 8 / window_s
    return BulkResult(goodput, goodput * (mtu + ETH_HEADER) / mss, mss, window_s, window_bytes)


def _open_connection(
    srv: socket.socket,
    cli: socket.socket,
    dst_addr: str,
    timeout_s: float,
    pacing_bps: float | None,
) -> socket.socket:
    """Connects ``cli`` to a listener on ``srv`` bound to ``dst_addr``.

    Args:
        srv: The receiver's TCP socket (not bound yet).
        cli: The sender's TCP socket.
        dst_addr: Address ``srv`` binds to (any port).
        timeout_s: Timeout of every blocking call on both sockets.
        pacing_bps: Cap on the sender's rate (frames counted), or ``None``.

    Returns:
        The receiver's end of the accepted connection.

    Raises:
        TimeoutError: the connection was not made in ``timeout_s``.
        OSError: another socket error (e.g. unreachable).
    """
    srv.bind((dst_addr, 0))
    srv.listen(1)
    srv.settimeout(timeout_s)
    cli.settimeout(timeout_s)
    if pacing_bps is not None:
        cli.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(pacing_bps / 8))
    cli.connect(srv.getsockname())
    conn, _ = srv.accept()
    return conn


def _run_window(
    conn: socket.socket,
    cli: socket.socket,
    done: threading.Event,
    warmup_s: float,
    duration_s: float,
    timeout_s: float,
) -> tuple[int, float, int]:
    """Sends from ``cli`` in a thread while ``conn`` measures one window, then stops the sender.

    ``conn`` is closed on return.

    Args:
        conn: The receiver's end of the connection.
        cli: The sender's socket.
        done: Set (also on error) to stop the sender.
        warmup_s: Time ignored before the window.
        duration_s: The measuring window.
        timeout_s: Timeout of ``conn``'s reads and of waiting for the sender to stop.

    Returns:
        ``(window_bytes, window_s, mss)``.

    Raises:
        TimeoutError: no data flowed for ``timeout_s``.
        ChaosTimeout: the window did not end in ``warmup_s + duration_s + timeout_s``.
        OSError: another socket error.
    """
    sender = threading.Thread(target=_send_until, args=(cli, done), daemon=True)
    sender.start()
    try:
        with conn:
            conn.settimeout(timeout_s)
            window_bytes, window_s = _receive_window(conn, warmup_s, duration_s, timeout_s)
            mss = cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    finally:
        done.set()
    sender.join(timeout_s)
    return window_bytes, window_s, mss


def _send_until(sock: socket.socket, done: threading.Event) -> None:
    data = memoryview(bytearray(CHUNK))
    try:
        while not done.is_set():
            sock.send(data)
    except OSError:
        pass  # the receiver closed (the window is over) or the transfer was abandoned


def _bytes_received(conn: socket.socket) -> int:
    """``tcpi_bytes_received``: payload bytes the kernel took in, counted when they arrived."""
    info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    if len(info) < TCPI_BYTES_RECEIVED + 8:
        raise OSError("kernel too old: TCP_INFO lacks tcpi_bytes_received (Linux >= 4.1)")
    return int(struct.unpack_from("=Q", info, TCPI_BYTES_RECEIVED)[0])


def _receive_window(
    conn: socket.socket, warmup_s: float, duration_s: float, timeout_s: float
) -> tuple[int, float]:
    """Reads until the window is over; returns (bytes, seconds) of the window.

    Bytes are the kernel's arrival count (TCP_INFO), not what this thread read: a receiver
    descheduled by a busy CPU would otherwise count a backlog that arrived before the window.
    """
    buf = bytearray(1 << 20)
    if conn.recv_into(buf) == 0:
        raise ConnectionError("sender closed before sending")
    start = time.monotonic() + warmup_s
    end = start + duration_s
    hard_end = end + timeout_s
    t0: float | None = None
    b0 = 0
    while True:
        if conn.recv_into(buf) == 0:
            raise ConnectionError("sender closed early")
        t = time.monotonic()
        if t > hard_end:
            raise ChaosTimeout("bulk transfer did not finish")
        if t0 is None:
            if t >= start:
                b0, t0 = _bytes_received(conn), time.monotonic()
            continue
        if t >= end:
            b1, t1 = _bytes_received(conn), time.monotonic()
            return b1 - b0, t1 - t0


@dataclass(frozen=True)
class PingResult:
    """UDP ping-pong round-trip times.

    Attributes:
        rtts_s: Every answered round trip, seconds, in order.
        sent: Probes sent.
    """

    rtts_s: tuple[float, ...]
    sent: int

    @property
    def lost(self) -> int:
        """Probes without an answer."""
        return self.sent - len(self.rtts_s)

    @property
    def median_rtt_s(self) -> float:
        """Median round trip, seconds (``nan`` if none answered)."""
        return statistics.median(self.rtts_s) if self.rtts_s else float("nan")

    @property
    def one_way_s(self) -> float:
        """Half the median round trip: the path's one-way delay if it is symmetric."""
        return self.median_rtt_s / 2


def ping(
    src_ns: str,
    dst_ns: str,
    dst_addr: str,
    *,
    count: int = 30,
    interval_s: float = 0.01,
    timeout_s: float = 1.0,
    stop: threading.Event | None = None,
) -> PingResult:
    """UDP ping-pong from ``src_ns`` to an echo socket on ``dst_addr`` in ``dst_ns``.

    Args:
        src_ns: The pinging side's namespace.
        dst_ns: The echoing side's namespace.
        dst_addr: Address the echo socket binds to.
        count: Probes to send (fewer if ``stop`` is set first).
        interval_s: Pause between an answer (or a loss) and the next probe.
        timeout_s: How long a probe waits for its answer before counting as lost.
        stop: Ends the series early when set.

    Returns:
        The round-trip times; a probe that could not be sent (no route) counts as lost.

    Raises:
        OSError: the echo socket cannot bind (the address does not exist in ``dst_ns``).
    """
    if count < 1 or interval_s < 0 or timeout_s <= 0:
        raise ValueError("count must be >= 1, interval_s >= 0, timeout_s > 0")
    echo = netns_socket(dst_ns, socket.SOCK_DGRAM)
    cli = netns_socket(src_ns, socket.SOCK_DGRAM)
    halt = threading.Event()
    try:
        echo.bind((dst_addr, 0))
        echo.settimeout(0.1)
        cli.settimeout(timeout_s)
        t = threading.Thread(target=_echo, args=(echo, halt), daemon=True)
        t.start()
        rtts, sent = _probe_series(cli, echo, count, interval_s, timeout_s, stop)
        halt.set()
        t.join(1.0)
    finally:
        halt.set()
        cli.close()
        echo.close()
    return PingResult(tuple(rtts), sent)


def _probe_series(
    cli: socket.socket,
    echo: socket.socket,
    count: int,
    interval_s: float,
    timeout_s: float,
    stop: threading.Event | None,
) -> tuple[list[float], int]:
    """Sends numbered probes from ``cli`` to ``echo`` one at a time, each awaiting its answer.

    Args:
        cli: The pinging UDP socket.
        echo: The echo socket (its address is the probes' destination).
        count: Probes to send (fewer if ``stop`` is set first).
        interval_s: Pause between an answer (or a loss) and the next probe.
        timeout_s: How long a probe waits for its answer before counting as lost.
        stop: Ends the series early when set.

    Returns:
        ``(rtts_s, sent)``: the answered round trips in order, and the probes sent (a probe
        that could not be sent counts as sent and lost).
    """
    rtts: list[float] = []
    sent = 0
    for seq in range(count):
        if stop is not None and stop.is_set():
            break
        sent += 1
        t_send = time.perf_counter()
        try:
            cli.sendto(struct.pack("!Q", seq), echo.getsockname())
        except OSError:  # no route (e.g. partitioned): a lost probe
            rtt = None
        else:
            rtt = _await_echo(cli, seq, t_send, timeout_s)
        if rtt is not None:
            rtts.append(rtt)
        if interval_s:
            time.sleep(interval_s)
    return rtts, sent


def _await_echo(cli: socket.socket, seq: int, t_send: float, timeout_s: float) -> float | None:
    deadline = t_send + timeout_s
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        cli.settimeout(left)
        try:
            data = cli.recv(64)
        except TimeoutError:
            return None
        if len(data) == 8 and struct.unpack("!Q", data)[0] == seq:
            return time.perf_counter() - t_send


def _echo(sock: socket.socket, halt: threading.Event) -> None:
    while not halt.is_set():
        try:
            data, addr = sock.recvfrom(64)
            sock.sendto(data, addr)
        except TimeoutError:
            continue
        except OSError:
            return
