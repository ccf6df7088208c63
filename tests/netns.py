"""Test hosts in network namespaces: each host a namespace of its own with one address,
all joined by a bridge that lives in a namespace of its own too, so that the machine's
own network is never touched and the addresses exist only inside the namespaces.

Root only (``ip netns``, from iproute2): :func:`why_no_netns` says why not, for a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path


def sh(*argv: str, check: bool = True, input: str | None = None) -> str:
    """Run a command (``ip``, ``nft``) and return its output; a failure says what failed."""
    done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def why_no_netns() -> str | None:
    """Why this session cannot make network namespaces, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); this session is not root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"flymc-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ipv4(ip_json: str) -> set[str]:
    """The IPv4 addresses in the output of ``ip -j addr``."""
    links = json.loads(ip_json)
    return {
        a["local"] for link in links for a in link.get("addr_info", []) if a["family"] == "inet"
    }


class Layout:
    """Hosts ``{name: address}``, each a namespace ``flymc-<pid>-<tag>-<name>`` with one
    veth leg (``eth0``) on a bridge in the namespace ``…-net``, and the processes started
    in them. :meth:`close` ends the processes and deletes the namespaces (and so their
    links); it is safe on a half-made layout, and is the fixtures' finalizer."""

    def __init__(self, tmp: Path, hosts: dict[str, str], subnet_bits: int, tag: str) -> None:
        self.prefix = f"flymc-{os.getpid()}-{tag}"
        self.tmp = tmp
        self.hosts = dict(hosts)
        self.subnet_bits = subnet_bits
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}

    def ns(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.prefix}-{host}"

    def build(self, default_route: bool = False) -> None:
        """Make the namespaces, the bridge and the links; ``default_route``: each host's
        default route points at the bridge (nothing is behind it: as a pod's, it lets a
        program find its own address by routing)."""
        bridge = self.ns("net")
        self._add_ns(bridge)
        sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(self.hosts.items()):
            ns = self.ns(host)
            self._add_ns(ns)
            # both legs are made inside the host's namespace, then one is moved to the
            # bridge's: no link ever appears in the machine's own namespace
            leg = f"leg{i}"
            sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", leg)
            sh("ip", "-n", ns, "link", "set", leg, "netns", bridge)
            sh("ip", "-n", bridge, "link", "set", leg, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet_bits}", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if default_route:
                sh("ip", "-n", ns, "route", "add", "default", "dev", "eth0")

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        return dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False", **(env or {}))

    def start(
        self, host: str, argv: list[str], name: str | None = None, env: dict | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace (``env`` added to this process's), its
        output to a log file."""
        name = name or host
        log = self.tmp / f"{self.prefix}-{name}.log"
        self.logs[name] = log
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(host), *argv],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self._env(env),
            )
        self.procs.append(proc)
        return proc

    def run(
        self, host: str, argv: list[str], timeout: float, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host``'s namespace to completion."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._env(env),
        )

    def all_logs(self) -> str:
        """The end of every started process's output, for a failure's message."""
        return "".join(
            f"\n--- {name}\n{path.read_text(errors='replace')[-3000:]}"
            for name, path in self.logs.items()
            if path.exists()
        )

    def close(self) -> None:
        """End the processes (the last started first), then delete the namespaces."""
        for p in self.procs[::-1]:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.namespaces[::-1]:
            # anything still running in a namespace of ours was started by this test
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
