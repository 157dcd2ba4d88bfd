"""A shaped link on this machine: P processes, each in its own network namespace on a bandwidth-limited link.

    python benchmarks/shaped_link.py --procs 4 --rate 100mbit -- python my_script.py   (as root)

makes P + 1 network namespaces: ``<name>-sw`` holding a bridge, and ``<name>-0`` ... ``<name>-(P-1)``, each
joined to the bridge by a veth pair (``eth0`` inside it, ``port<i>`` on the bridge) with the address
``10.77.0.<i + 1>/24``. Both ends of every pair are shaped with
``tc qdisc add dev <end> root tbf rate <rate> burst 256kb latency 200ms``, so that each process sends and
receives at most ``rate``: every machine on its own link of that speed, full duplex, as the ring model of
``lit_slowcal/link.py`` assumes. ``--rate none`` makes the same namespaces unshaped (the veth pairs at the
CPU's speed: what the same command costs where the link is no limit).

The command runs once in each namespace (``ip netns exec``), with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` (rank 0's address, on the namespaces' subnet), ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=eth0``
set, so that ``torch.distributed.init_process_group("gloo")`` (``init_method="env://"``) meets inside them and
its traffic crosses the shaped links. The harness waits for every process; the first that fails stops the
others. On exit, after a failure, Ctrl-C or SIGTERM, it stops the processes it started (by their process
groups) and deletes the namespaces it made, which removes the veth pairs, the bridge and the shaping with
them: nothing is made outside these namespaces, and nothing is left behind.

It refuses in one line where the namespaces cannot be made: not root, no CAP_NET_ADMIN or CAP_SYS_ADMIN,
no ``ip`` or ``tc``; and where making them fails all the same, it says which command failed and removes
what it made. ``ShapedLink`` is the same as a context manager (``benchmarks/bench_shaped_link.py`` uses it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Optional

SUBNET = "10.77.0"  # the namespaces' addresses: SUBNET.1 ... SUBNET.P, /24
PORT = 29577  # the rendezvous port on rank 0's address (inside fresh namespaces every port is free)
IFNAME = "eth0"  # every process's end of its link, inside its namespace
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21  # ``ip netns add`` mounts the namespace's file


class Refused(RuntimeError):
    """The namespaces cannot be made here: the message is one line saying why."""


def effective_capabilities(status: str = "/proc/self/status") -> int:
    """This process's effective capability bits (``CapEff`` of ``/proc/self/status``; 0 where unreadable)."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def refusal() -> Optional[str]:
    """Why network namespaces cannot be made here, in one line, or ``None`` where they can (as far as can be
    told before trying): root, CAP_NET_ADMIN and CAP_SYS_ADMIN effective, ``ip`` and ``tc`` on the PATH."""
    if os.geteuid() != 0:
        return f"not root (effective uid {os.geteuid()}): network namespaces and tc need root"
    caps = effective_capabilities()
    missing = [
        name
        for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not caps >> bit & 1
    ]
    if missing:
        return f"root without {' and '.join(missing)} (a container's limits?): namespaces and links cannot be made"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on the PATH (iproute2): namespaces and shaping need it"
    return None


@dataclass(frozen=True)
class Plan:
    """What the harness makes: ``procs`` namespaces on a bridge, each link shaped at ``rate`` (a tc rate such
    as ``"100mbit"``; ``None``: unshaped), named ``<name>-sw`` and ``<name>-<i>``."""

    procs: int
    rate: Optional[str] = "100mbit"
    burst: str = "256kb"
    latency: str = "200ms"
    #: The kernel's ``net.ipv4.tcp_slow_start_after_idle`` in each process's namespace (a per-namespace setting):
    #: ``True`` (the kernel's default), a connection idle for longer than its retransmission timeout starts its
    #: window again; ``False`` (``sysctl ... = 0``), it keeps its window across the compute between two rounds.
    slow_start_after_idle: bool = True
    name: str = f"slc{os.getpid()}"
    subnet: str = SUBNET
    port: int = PORT

    def __post_init__(self) -> None:
        if not 1 <= self.procs <= 250:
            raise ValueError(f"Invalid procs: {self.procs} (1 to 250 processes)")

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def namespace(self, rank: int) -> str:
        return f"{self.name}-{rank}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def namespaces(self) -> list[str]:
        return [self.switch] + [self.namespace(i) for i in range(self.procs)]

    def setup_commands(self) -> list[list[str]]:
        """The commands that make it, in order (each one made is removed by ``teardown_commands``)."""
        sw = self.switch
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces()]
        cmds += [
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "dev", "br0", "up"],
        ]
        for i in range(self.procs):
            ns, port = self.namespace(i), f"port{i}"
            cmds += [
                ["ip", "link", "add", "name", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw],
                ["ip", "-n", sw, "link", "set", "dev", port, "master", "br0"],
                ["ip", "-n", sw, "link", "set", "dev", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME],
                ["ip", "-n", ns, "link", "set", "dev", IFNAME, "up"],
                ["ip", "-n", ns, "link", "set", "dev", "lo", "up"],
            ]
            if not self.slow_start_after_idle:
                cmds.append(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"])
            if self.rate is not None:  # both ends: what the process sends, and what reaches it
                for where, dev in ((ns, IFNAME), (sw, port)):
                    cmds.append(["ip", "netns", "exec", where, *self.tbf(dev)])
        return cmds

    def tbf(self, dev: str) -> list[str]:
        """The shaping of one end: ``tc qdisc add dev <dev> root tbf rate <rate> burst <burst> latency <latency>``."""
        assert self.rate is not None
        return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]  # fmt: skip

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces removes every link, the bridge and the shaping in them."""
        return [["ip", "netns", "delete", ns] for ns in reversed(self.namespaces())]

    def process_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def process_env(self, rank: int, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the rendezvous of ``rank``: inside the namespaces, over the shaped links."""
        return {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.procs),
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": IFNAME,
        }


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[0]
        raise Refused(f"`{' '.join(cmd)}` failed: {first}")


class _Terminated(BaseException):
    """SIGTERM, raised where the harness waits, so that its clean-up runs."""


class ShapedLink:
    """The namespaces of ``plan`` while the ``with`` block runs; ``run(argv)`` runs a command in each."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.made: list[str] = []  # the namespaces made so far (removed on exit, whatever happened)
        self.stopped: list[int] = []  # the ranks the last run stopped because another had failed
        self._previous: object = None

    def __enter__(self) -> ShapedLink:
        why = refusal()
        if why is not None:
            raise Refused(why)
        if threading_main():
            self._previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            existing = set(_namespaces())
            clash = [ns for ns in self.plan.namespaces() if ns in existing]
            if clash:
                raise Refused(f"namespace {clash[0]} exists already (another harness?): choose another name")
            for cmd in self.plan.setup_commands():
                _run(cmd)
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.made.append(cmd[3])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespaces made (their links, bridge and shaping go with them)."""
        for cmd in self.plan.teardown_commands():
            if cmd[3] in self.made:
                subprocess.run(cmd, capture_output=True, timeout=30)
                self.made.remove(cmd[3])
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def run(self, argv: Sequence[str], timeout: float = 600, env: Optional[Mapping[str, str]] = None) -> list[int]:
        """Run ``argv`` in every namespace (rank i in namespace i) and wait; the exit statuses by rank. A process
        that fails stops the others; ``timeout`` seconds in all stops every one (``TimeoutError``)."""
        base = dict(os.environ if env is None else env)
        procs = [
            subprocess.Popen(self.plan.process_command(i, argv), env=self.plan.process_env(i, base), start_new_session=True)
            for i in range(self.plan.procs)
        ]  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while None in (states := [p.poll() for p in procs]):
                if any(states):
                    break  # one failed: the others would wait for it for ever
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the command ran past {timeout:g} s in {self.plan.procs} namespaces")
                time.sleep(0.05)
        finally:
            self.stopped = [i for i, p in enumerate(procs) if p.poll() is None]  # the ranks this harness stops
            for p in procs:  # the processes this harness started, each by its own process group
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
        return [p.returncode for p in procs]


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum: int, frame: Optional[FrameType]) -> None:
    raise _Terminated()


def _namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="processes, one per namespace (default 2)")
    p.add_argument("--rate", default="100mbit", help="each link's rate, as tc writes it (100mbit, 1gbit), or none")
    p.add_argument("--burst", default="256kb", help="tbf's burst (default 256kb)")
    p.add_argument("--latency", default="200ms", help="tbf's latency: the longest a packet may wait (default 200ms)")
    p.add_argument("--timeout", type=float, default=600, help="seconds the command may run in all (default 600)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (shaped_link.py [options] -- command ...)")
    rate = None if args.rate.lower() == "none" else args.rate
    try:
        with ShapedLink(Plan(args.procs, rate, burst=args.burst, latency=args.latency)) as net:
            codes = net.run(command, timeout=args.timeout)
    except (Refused, ValueError) as e:  # ValueError: a bad --procs, --rate, ... (nothing made)
        print(f"shaped_link: refused: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated):
        print("shaped_link: stopped; the namespaces are removed", file=sys.stderr)
        return 130
    except TimeoutError as e:
        print(f"shaped_link: {e}; the namespaces are removed", file=sys.stderr)
        return 124
    # The first process that failed on its own: not one this harness stopped because another had failed.
    failed = [c for i, c in enumerate(codes) if c and i not in net.stopped] or [c for c in codes if c]
    return (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0


if __name__ == "__main__":
    sys.exit(main())
