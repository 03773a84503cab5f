"""`myria cluster`: a cluster of emulated hosts on this Linux machine, under a real Slurm.

    myria cluster up 2                  # hosts h0, h1 + a login node running slurmctld
    myria cluster exec login sbatch -N2 scripts/slurm/myria.sbatch ...
    myria cluster exec login sinfo
    myria cluster kill-host h1 | revive h1 | partition h1 | heal h1 | slow-link h1 1mbit
    myria cluster fail-diagnostics h1
    myria cluster down                  # every process by pid, every namespace

Each host is a Linux network namespace (its own address in 198.18.0.0/15, host name, /dev/shm
and network stack) joined by a bridge in a "switch" namespace; the launcher is Debian's Slurm
(`slurmctld` on the login node, one `slurmd` per host, `munged`); the rest of the filesystem is
shared and plays the cluster's shared filesystem. Faults: `kill-host H` (every process of the
host; `revive H` starts it again), `partition H` / `heal H` (its switch port down / up:
connections hang), `slow-link H RATE|off` (`tc tbf` on its link) and `fail-diagnostics H` (its
self-check diagnostics fail from then on). State (config, logs, pids) lives in
$MYRIA_CLUSTER_DIR (default /tmp/myria-cluster). Root only. Why it is built so, and the
kernel and Slurm facts it relies on: docs/cluster.md, "Reasons behind the cluster module".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from myria.errors import MyriaError
from myria.fsutil import atomic_write_json, pid_alive

STATE_ENV = "MYRIA_CLUSTER_DIR"
PREFIX = "myria-"            # namespace names: myria-sw, myria-login, myria-h0, ...
SUBNET = "198.18.0.0/16"     # within 198.18.0.0/15 (RFC 2544)
LOGIN = "login"
LOGIN_ADDR = "198.18.0.1"
HOST_IF = "eth0"             # each host's side of its link
PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "munged": "munge", "ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux",
            "unshare": "util-linux"}
CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "pids")
# what `fail-diagnostics` leaves in a host's own /dev/shm: the doctor's test-hook spec for that
# host only (myria.resilience.checks.hooks.HOST_FAULT_FILE): every GEMM result perturbed
DIAG_FAULT_SPEC = "wrong-gemm"
# which state directory's cluster owns the machine's myria-* namespaces (one machine-wide set of
# names: a second cluster would take over the first one's namespaces and orphan its daemons)
OWNER = Path("/run/myria-cluster-owner")
RATE = re.compile(r"\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)")


class ClusterError(MyriaError):
    """The emulated cluster cannot be brought up or used as asked."""


def state_dir() -> Path:
    return Path(os.environ.get(STATE_ENV, "/tmp/myria-cluster"))


def host_addr(i: int) -> str:
    return f"198.18.1.{i + 1}"


def ns(name: str) -> str:
    return PREFIX + name


# -- checks ----------------------------------------------------------------------------------
def missing() -> str:
    """Why the cluster cannot be used here ("" when it can): not root, or a package missing."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts, Slurm daemons); run it as root"
    gone = sorted({pkg for exe, pkg in PACKAGES.items() if not shutil.which(exe)
                   and not Path("/usr/sbin", exe).exists()})
    if gone:
        return (f"missing Debian package(s) {', '.join(gone)}: `make cluster-packages` or "
                f"`apt-get install -y {' '.join(gone)}`")
    return ""


def _require() -> None:
    if why := missing():
        raise ClusterError(why)


def _sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` exited {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip()[-300:]}")
    return p


def _netns_list() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# -- state -----------------------------------------------------------------------------------
def read_state() -> dict:
    p = state_dir() / "state.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _write_state(s: dict) -> None:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "state.json", s)
    OWNER.write_text(str(d))


def owner() -> str:
    """The state directory of the cluster whose namespaces are up on this machine ("" when
    none: no record, or its namespaces are gone)."""
    try:
        who = OWNER.read_text().strip()
    except OSError:
        return ""
    return who if any(x.startswith(PREFIX) for x in _netns_list()) else ""


def slurm_conf() -> Path:
    return state_dir() / "etc" / "slurm.conf"


def hosts() -> list[str]:
    return list(read_state().get("hosts", []))


def is_up() -> bool:
    s = read_state()
    pids = [s.get("munged", 0), s.get("slurmctld", 0), *s.get("slurmd", {}).values()]
    return bool(s.get("hosts")) and all(p and pid_alive(p) for p in pids)


# -- up --------------------------------------------------------------------------------------
def _slurm_conf(d: Path, names: list[str]) -> str:
    nodes = "\n".join(f"NodeName={h} NodeAddr={host_addr(i)} CPUs={os.cpu_count() or 1} "
                      f"State=UNKNOWN" for i, h in enumerate(names))
    return f"""# written by `myria cluster up` (an emulated cluster; see myria/cluster.py)
ClusterName=myria
SlurmctldHost={LOGIN}({LOGIN_ADDR})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
StateSaveLocation={d}/slurm/state
SlurmdSpoolDir={d}/slurm/spool/%n
SlurmdPidFile={d}/slurm/slurmd-%n.pid
SlurmctldPidFile={d}/slurm/slurmctld.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


CGROUP_CONF = """CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
"""


def _host_script(d: Path) -> Path:
    """The script each namespace's daemon starts through: its host name, its own /dev/shm,
    for a compute host its own cgroup v1 hierarchy, then `exec` the daemon (same pid)."""
    p = d / "etc" / "host.sh"
    mounts = " && ".join([
        "mount -t tmpfs cgroup_root /sys/fs/cgroup",
        "mkdir -p /sys/fs/cgroup/systemd",
        "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd",
        *(f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
          for c in CGROUPS)])
    p.write_text(f"""#!/bin/sh
# $1 host name, $2 cgroups|nocgroups, then the daemon's command line
set -e
name=$1; cg=$2; shift 2
hostname "$name"
mount -t tmpfs -o size=50% shm /dev/shm
if [ "$cg" = cgroups ]; then {mounts}; fi
exec "$@"
""")
    p.chmod(0o755)
    return p


def _daemon(d: Path, name: str, cgroups: bool, cmd: list[str]) -> int:
    log = open(d / "log" / f"{name}.out", "ab")
    p = subprocess.Popen(["ip", "netns", "exec", ns(name), "unshare", "--uts",
                          str(d / "etc" / "host.sh"), name,
                          "cgroups" if cgroups else "nocgroups", *cmd],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    log.close()
    return p.pid


def up(n: int, quiet: bool = False) -> dict:
    """Bring up `n` hosts h0..h{n-1}, the switch, the login node, munge, slurmctld and one
    slurmd per host, and wait until Slurm shows every node idle. Idempotent: a cluster already
    up with `n` hosts is left as it is; one half up (a daemon gone) is taken down first."""
    _require()
    if not 1 <= n <= 200:
        raise ClusterError(f"up {n}: the number of hosts must be 1..200")
    s = read_state()
    other = owner()
    if other and other != str(state_dir()):
        raise ClusterError(f"up {n}: the cluster of {STATE_ENV}={other} is up on this machine "
                           "(one set of namespaces per machine); take it down first: "
                           f"`{STATE_ENV}={other} myria cluster down`")
    if s.get("hosts") and is_up():
        if len(s["hosts"]) == n:
            if not quiet:
                print(f"myria cluster: already up with {n} host(s): {' '.join(s['hosts'])}")
            return s
        raise ClusterError(f"up {n}: already up with {len(s['hosts'])} host(s); "
                           "`myria cluster down` first")
    down(quiet=True)
    d = state_dir()
    for sub in ("etc", "log", "munge", "slurm/state", "slurm/spool", "shared"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    names = [f"h{i}" for i in range(n)]
    s = {"hosts": names, "namespaces": [], "slurmd": {}, "started": time.time(),
         "dir": str(d)}
    _write_state(s)
    hosts_file = "".join([f"{LOGIN_ADDR} {LOGIN}\n"] + [f"{host_addr(i)} {h}\n"
                                                       for i, h in enumerate(names)])
    # the switch: a bridge in its own namespace
    _sh("ip", "netns", "add", ns("sw"))
    s["namespaces"].append(ns("sw"))
    _write_state(s)
    _sh("ip", "-n", ns("sw"), "link", "add", "br0", "type", "bridge")
    _sh("ip", "-n", ns("sw"), "link", "set", "br0", "up")
    for i, name in enumerate([LOGIN, *names]):
        addr = LOGIN_ADDR if name == LOGIN else host_addr(i - 1)
        _sh("ip", "netns", "add", ns(name))
        s["namespaces"].append(ns(name))
        _write_state(s)
        etc = Path("/etc/netns") / ns(name)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts_file}")
        port = f"v{name}"[:15]
        _sh("ip", "link", "add", port, "netns", ns("sw"), "type", "veth", "peer", "name",
            HOST_IF, "netns", ns(name))
        _sh("ip", "-n", ns("sw"), "link", "set", port, "master", "br0")
        _sh("ip", "-n", ns("sw"), "link", "set", port, "up")
        _sh("ip", "-n", ns(name), "addr", "add", f"{addr}/16", "dev", HOST_IF)
        _sh("ip", "-n", ns(name), "link", "set", HOST_IF, "up")
        _sh("ip", "-n", ns(name), "link", "set", "lo", "up")
    # configs, munge key, daemons
    (d / "etc" / "slurm.conf").write_text(_slurm_conf(d, names))
    (d / "etc" / "cgroup.conf").write_text(CGROUP_CONF)
    _host_script(d)
    for h in names:
        (d / "slurm" / "spool" / h).mkdir(parents=True, exist_ok=True)
    key = d / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    shutil.chown(d / "munge", "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    (d / "munge").chmod(0o700)
    mlog = open(d / "log" / "munged.out", "ab")
    m = subprocess.Popen(["setpriv", "--reuid=munge", "--regid=munge", "--init-groups",
                          "munged", "-F", "--force",
                          f"--socket={d}/munge/munge.socket", f"--key-file={key}",
                          f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                          f"--seed-file={d}/munge/munged.seed"],
                         stdout=mlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    mlog.close()
    s["munged"] = m.pid
    _write_state(s)
    _wait(lambda: (d / "munge" / "munge.socket").exists(), 20, "munged to open its socket",
          d / "log" / "munged.out")
    (d / "munge").chmod(0o755)  # the daemons (root) and users reach the socket
    conf = str(d / "etc" / "slurm.conf")
    s["slurmctld"] = _daemon(d, LOGIN, False, ["slurmctld", "-D", "-c", "-f", conf])
    _write_state(s)
    for h in names:
        s["slurmd"][h] = _daemon(d, h, True, ["slurmd", "-D", "-f", conf, "-N", h])
        _write_state(s)
    _wait(lambda: _all_idle(names), 90, "every Slurm node to be idle",
          d / "log" / "slurmctld.log")
    if not quiet:
        print(f"myria cluster: up: {n} host(s) {' '.join(names)} "
              f"({', '.join(host_addr(i) for i in range(n))}), login node {LOGIN} "
              f"({LOGIN_ADDR}) running slurmctld; state in {d}")
    return s


def _wait(ok, timeout: float, what: str, logfile: Path) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if ok():
            return
        time.sleep(0.3)
    tail = ""
    try:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-1][-300:]
    except (OSError, IndexError):
        pass
    down(quiet=True)
    raise ClusterError(f"timed out after {timeout:g} s waiting for {what}"
                       + (f"; {logfile}: {tail}" if tail else ""))


def node_states() -> dict[str, str]:
    """Slurm's state of each node (`sinfo -N`), from the login node; {} when unreachable."""
    try:
        p = exec_on(LOGIN, ["sinfo", "-h", "-N", "-o", "%N %t"], capture=True, timeout=20)
    except (ClusterError, subprocess.TimeoutExpired):
        return {}
    if p.returncode != 0:
        return {}
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def _all_idle(names: list[str]) -> bool:
    st = node_states()
    return all(st.get(h) == "idle" for h in names)


# -- use -------------------------------------------------------------------------------------
def _pid_of(host: str) -> int:
    s = read_state()
    if not s.get("hosts"):
        raise ClusterError("the emulated cluster is not up (`myria cluster up N`)")
    pid = s.get("slurmctld") if host == LOGIN else s.get("slurmd", {}).get(host)
    if host != LOGIN and host not in s.get("hosts", []):
        raise ClusterError(f"no host {host!r} in the emulated cluster; hosts: "
                           f"{', '.join([LOGIN, *s.get('hosts', [])]) or 'none (not up)'}")
    if not pid or not pid_alive(pid):
        raise ClusterError(f"host {host} is down (its daemon is gone: killed, or the cluster "
                           "is not up)")
    return int(pid)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["SLURM_CONF"] = str(slurm_conf())
    return e


def _nsenter(pid: int) -> list[str]:
    """Enter the namespaces of a host's daemon `pid`, in the caller's working directory."""
    return ["nsenter", "-t", str(pid), "-n", "-m", "-u", f"--wd={os.getcwd()}", "--"]


def exec_on(host: str, cmd: list[str], capture: bool = False, timeout: float | None = None,
            **kw) -> subprocess.CompletedProcess:
    """Run `cmd` on `host` (a compute host or the login node): in its network, mount and UTS
    namespaces (its address, /dev/shm and host name), with SLURM_CONF set."""
    pid = _pid_of(host)
    return subprocess.run(_nsenter(pid) + cmd, env=env(), capture_output=capture, text=True,
                          timeout=timeout, **kw)


def popen_on(host: str, cmd: list[str], **kw) -> subprocess.Popen:
    pid = _pid_of(host)
    return subprocess.Popen(_nsenter(pid) + cmd, env=kw.pop("env", None) or env(), **kw)


def sbatch(script: str | Path, nodes: int, args: list[str], output: str | Path,
           extra_env: dict[str, str] | None = None) -> int:
    """Submit `script ARGS` for `nodes` nodes from the login node (the caller's environment
    goes with the job, as sbatch's default --export=ALL does); returns the job id."""
    e = env()
    e.update(extra_env or {})
    pid = _pid_of(LOGIN)
    p = subprocess.run(_nsenter(pid) + ["sbatch", "--parsable", "-N", str(nodes), "-o",
                                        str(output), str(script), *args],
                       env=e, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise ClusterError(f"sbatch exited {p.returncode}: {p.stderr.strip()[-300:]}")
    return int(p.stdout.strip().split(";")[0])


def job_state(job: int) -> str:
    """Slurm's state of job `job` (PENDING, RUNNING, COMPLETED, FAILED, ...); "" if unknown."""
    p = exec_on(LOGIN, ["scontrol", "-o", "show", "job", str(job)], capture=True, timeout=20)
    for word in p.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return ""


def wait_job(job: int, timeout: float) -> str:
    """Wait for job `job` to end; its final state (or the last seen one on the timeout)."""
    end, state = time.time() + timeout, ""
    while time.time() < end:
        state = job_state(job)
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(1.0)
    return state


def kill_host(host: str) -> list[int]:
    """A lost host: SIGKILL every process in its namespace (slurmd, job steps, workers)."""
    _pid_of(host)
    pids = _ns_pids(ns(host))
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.time() + 10   # SIGKILL takes effect asynchronously: gone when this returns
    while any(pid_alive(p) for p in pids) and time.time() < end:
        time.sleep(0.05)
    return pids


def revive(host: str, timeout: float = 90.0) -> int:
    """A killed host back: its slurmd started again in its namespace (a fresh /dev/shm, as
    after a reboot), and Slurm's view of it waited for until it is usable again (idle, or
    already given to a job waiting for nodes: ReturnToService=2 takes a node that registers
    back into service). Returns the new slurmd's pid."""
    _check_host(host)
    s = read_state()
    pid = s.get("slurmd", {}).get(host)
    if pid and pid_alive(pid):
        raise ClusterError(f"revive {host}: it is up (slurmd pid {pid}); `kill-host {host}` "
                           "first to restart it")
    d = state_dir()
    s["slurmd"][host] = _daemon(d, host, True, ["slurmd", "-D", "-f", str(slurm_conf()),
                                                "-N", host])
    _write_state(s)
    end = time.time() + timeout
    while time.time() < end:
        if node_states().get(host) in ("idle", "mix", "alloc", "comp"):   # "*": not responding
            return s["slurmd"][host]
        if not pid_alive(s["slurmd"][host]):
            break
        time.sleep(0.5)
    raise ClusterError(f"revive {host}: Slurm does not show it back within {timeout:g} s "
                       f"(state {node_states().get(host, '?')!r}); its log: "
                       f"{d / 'log' / f'slurmd-{host}.log'}")


def partition(host: str, heal: bool = False) -> None:
    """Cut (or restore) the host's link at the switch: its packets are dropped from then on."""
    _check_host(host)
    _sh("ip", "-n", ns("sw"), "link", "set", f"v{host}"[:15], "up" if heal else "down")


def slow_link(host: str, rate: str) -> None:
    """Limit both directions of the host's link to `rate` (tc tbf), or remove it ("off")."""
    if rate != "off" and not RATE.fullmatch(rate):
        raise ClusterError(f"slow-link {host} {rate}: a rate as tc writes it (a number and "
                           "bit, kbit, mbit or gbit, e.g. 1mbit), or off")
    _check_host(host)
    ends = [(ns(host), HOST_IF), (ns("sw"), f"v{host}"[:15])]
    for space, dev in ends:
        _sh("tc", "-n", space, "qdisc", "del", "dev", dev, "root", check=False)
        if rate != "off":
            _sh("tc", "-n", space, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "32kbit", "latency", "400ms")


def fail_diagnostics(host: str, heal: bool = False) -> None:
    """The host's self-check diagnostics fail from now on (or pass again with heal)."""
    from myria.resilience.checks.hooks import HOST_FAULT_FILE

    cmd = ["rm", "-f", HOST_FAULT_FILE] if heal else \
        ["sh", "-c", f"echo {DIAG_FAULT_SPEC} > {HOST_FAULT_FILE}"]
    p = exec_on(host, cmd, capture=True)
    if p.returncode != 0:
        raise ClusterError(f"fail-diagnostics {host}: {p.stderr.strip()}")


def faults_of(host: str) -> list[str]:
    """The faults injected on `host` now, in words (its link cut or limited, its diagnostics
    made to fail)."""
    out = []
    link = _sh("ip", "-n", ns("sw"), "-o", "link", "show", f"v{host}"[:15], check=False).stdout
    if link and "<" in link and ",UP" not in link.split(">")[0] + ",":
        out.append("link cut (partition)")
    qd = _sh("tc", "-n", ns(host), "qdisc", "show", "dev", HOST_IF, check=False).stdout
    if m := re.search(r"tbf .*?rate (\S+)", qd):
        out.append(f"link limited to {m.group(1)}")
    from myria.resilience.checks.hooks import HOST_FAULT_FILE

    try:
        if exec_on(host, ["test", "-e", HOST_FAULT_FILE], capture=True).returncode == 0:
            out.append("diagnostics made to fail")
    except ClusterError:   # the host is down: nothing runs there to ask
        pass
    return out


def _check_host(host: str) -> None:
    if host not in hosts():
        raise ClusterError(f"no host {host!r} in the emulated cluster; hosts: "
                           f"{', '.join(hosts()) or 'none (not up)'}")


def _ns_pids(name: str) -> list[int]:
    if name not in _netns_list():
        return []
    out = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    return [int(x) for x in out if x.isdigit()]


# -- down ------------------------------------------------------------------------------------
def down(quiet: bool = False) -> list[str]:
    """Stop every process of the cluster (by pid: each namespace's processes, then the
    recorded daemons), delete every namespace; safe to call any time, twice included."""
    s = read_state()
    with contextlib.suppress(OSError):
        OWNER.unlink()
    spaces = [x for x in _netns_list() if x.startswith(PREFIX)]
    spaces = list(dict.fromkeys([*s.get("namespaces", []), *spaces]))
    pids = [p for name in spaces for p in _ns_pids(name)]
    pids += [p for p in [s.get("slurmctld"), *s.get("slurmd", {}).values(), s.get("munged")]
             if p]
    try:  # munged's own record of its pid (only if it is our munged)
        pid = int((state_dir() / "munge" / "munged.pid").read_text().split()[0])
        if str(state_dir() / "munge") in Path(f"/proc/{pid}/cmdline").read_text():
            pids.append(pid)
    except (OSError, ValueError, IndexError):
        pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.time() + 15
    while time.time() < end and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if pid_alive(p)]
    for name in spaces:
        _sh("ip", "netns", "del", name, check=False)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    if s:
        s.update(namespaces=[], slurmd={}, slurmctld=0, munged=0, hosts=[])
        _write_state(s)
    if left:
        raise ClusterError(f"down: process(es) {left} did not end after SIGKILL")
    if not quiet:
        print(f"myria cluster: down ({len(spaces)} namespace(s), {len(set(pids))} "
              "process(es) stopped)")
    return spaces


# -- the CLI ---------------------------------------------------------------------------------
HOST_HELP = "a host: h0 .. h{N-1} after `myria cluster up N` (`myria cluster status` lists them)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="bring up N hosts under Slurm (idempotent)")
    u.add_argument("n", type=int, help="number of hosts")
    sub.add_parser("down", help="stop every process and delete every namespace")
    sub.add_parser("status", help="the hosts, their daemons and Slurm's view (sinfo)")
    e = sub.add_parser("exec", help="run a command on a host (or the login node)")
    e.add_argument("host", help=HOST_HELP + ", or login (the login node: Slurm's commands)")
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    for name, help_ in (("kill-host", "kill every process of a host"),
                        ("revive", "start a killed host again (its slurmd back in Slurm)"),
                        ("partition", "cut a host's link at the switch"),
                        ("heal", "restore a host's link"),
                        ("fail-diagnostics", "make a host's self-check diagnostics fail")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("host", help=HOST_HELP)
        if name == "fail-diagnostics":
            q.add_argument("--heal", action="store_true", help="pass them again")
    s = sub.add_parser("slow-link", help="limit a host's link (tc tbf), e.g. 1mbit; off")
    s.add_argument("host", help=HOST_HELP)
    s.add_argument("rate", help="the link's rate as tc writes it (e.g. 1mbit, 500kbit), or "
                   "off to lift the limit")
    p.epilog = ("State in $MYRIA_CLUSTER_DIR (default /tmp/myria-cluster); root only. "
                "Slurm commands run on the login node: `myria cluster exec login sinfo`.")


def run(args) -> int:
    a = args.action
    _require()
    if a == "up":
        up(args.n)
    elif a == "down":
        down()
    elif a == "status":
        s = read_state()
        if not s.get("hosts"):
            other = owner()
            print("myria cluster: down" + (f" here; the cluster of {STATE_ENV}={other} is up"
                                           if other and other != str(state_dir()) else ""))
            return 0
        for h in [LOGIN, *s["hosts"]]:
            pid = s.get("slurmctld") if h == LOGIN else s.get("slurmd", {}).get(h)  # up: midway
            print(f"{h:<8} {'alive' if pid and pid_alive(pid) else 'DOWN'} "
                  f"({'slurmctld' if h == LOGIN else 'slurmd'} pid {pid})"
                  + "".join(f"; {x}" for x in ([] if h == LOGIN or not (pid and pid_alive(pid))
                                               else faults_of(h))))
        print(exec_on(LOGIN, ["sinfo"], capture=True).stdout.rstrip())
    elif a == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise ClusterError("exec HOST CMD...: no command given")
        return exec_on(args.host, cmd).returncode
    elif a == "kill-host":
        print(f"myria cluster: killed {len(kill_host(args.host))} process(es) of {args.host}")
    elif a == "revive":
        pid = revive(args.host)
        print(f"myria cluster: {args.host} is back (slurmd pid {pid}; Slurm shows it "
              f"{node_states().get(args.host, '?')})")
    elif a in ("partition", "heal"):
        partition(args.host, heal=a == "heal")
        print(f"myria cluster: {args.host}'s link "
              f"{'restored' if a == 'heal' else 'cut at the switch'}")
    elif a == "slow-link":
        slow_link(args.host, args.rate)
        print(f"myria cluster: {args.host}'s link "
              + ("unlimited" if args.rate == "off" else f"limited to {args.rate} each way"))
    elif a == "fail-diagnostics":
        fail_diagnostics(args.host, heal=args.heal)
        print(f"myria cluster: {args.host}'s self-check diagnostics "
              f"{'pass again' if args.heal else 'fail from now on'}")
    return 0

