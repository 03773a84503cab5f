"""Collective and point-to-point results and bandwidth, and the host list of a multi-host
launch (for the neighbour check)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from typing import Any

from myria.errors import ConfigError
from myria.resilience.checks.expected import throughput_check
from myria.resilience.checks.report import Check


def collective_check(name: str, res: Any, expected: float | None, source: str, tol: float,
                      rank: int | None = None, what: str = "") -> Check:
    details = res.to_dict()
    if not res.correct:
        return Check(name, "fail", f"wrong result on rank(s) {res.bad_ranks} (max deviation "
                     f"{res.max_error:.3g}){what}", rank, res.busbw_gbs, expected, "GB/s busbw",
                     details)
    note = f" ({res.world} ranks, {res.nbytes / 2**20:.0f} MiB{what})"
    c = throughput_check(name, rank, res.busbw_gbs, expected, source, tol, "GB/s busbw", note,
                          details=details)
    if c.status == "skip":   # the data check passed: that is a pass, without a figure to meet
        c.status = "pass"
        c.reason = "data correct; " + c.reason
    return c




def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list such as `gpu[01-03,07],login1` into host names."""
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    items.append(cur)
    hosts: list[str] = []
    for item in filter(None, (i.strip() for i in items)):
        hosts.extend(_expand_item(item))
    return hosts


def _expand_item(item: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    heads: list[str] = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if sep:
            width = len(lo)
            heads.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            heads.append(prefix + part)
    return [h + t for h in heads for t in _expand_item(rest)]


def neighbor_group(n_hosts: int, index: int) -> list[int]:
    """Indices of the hosts `index` is tested with: pairs in list order, a trio at an odd end."""
    if not 0 <= index < n_hosts:
        raise ValueError(f"host index {index} outside 0..{n_hosts - 1}")
    if n_hosts < 2:
        return [index]
    start = index - index % 2
    if n_hosts % 2 == 1 and start >= n_hosts - 3:
        return [n_hosts - 3, n_hosts - 2, n_hosts - 1]
    return [start, start + 1]


def discover_hosts(peer_hosts: Sequence[str] | None = None,
                   host_index: int | None = None) -> tuple[list[str], int | None, str]:
    """(host list, this host's index or None, where the list came from)."""
    env = os.environ
    if peer_hosts:
        hosts, source = [h.strip() for h in peer_hosts if h.strip()], "--peer-hosts"
    elif env.get("MYRIA_HOSTS"):
        hosts, source = [h.strip() for h in env["MYRIA_HOSTS"].split(",") if h.strip()], \
            "MYRIA_HOSTS"
    elif env.get("SLURM_STEP_NODELIST"):
        hosts, source = expand_nodelist(env["SLURM_STEP_NODELIST"]), "SLURM_STEP_NODELIST"
    else:
        return [socket.gethostname()], 0, "this host only"
    if host_index is None and env.get("MYRIA_HOST_INDEX"):
        try:
            host_index = int(env["MYRIA_HOST_INDEX"])
        except ValueError:
            raise ConfigError(f"MYRIA_HOST_INDEX={env['MYRIA_HOST_INDEX']!r} is not an "
                              "integer") from None
    if host_index is None:
        names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
        if env.get("SLURMD_NODENAME"):
            names = {env["SLURMD_NODENAME"]}
        matches = [i for i, h in enumerate(hosts) if h in names or h.split(".")[0] in names]
        host_index = matches[0] if len(matches) == 1 else None
    if host_index is not None and not 0 <= host_index < len(hosts):
        raise ConfigError(f"host index {host_index} is outside the host list of {len(hosts)} "
                          f"hosts ({source})")
    return hosts, host_index, source


