"""What the supervisor adds when a job spans several hosts (one `myria supervise` per host).

- One summary of the job: each host's supervisor writes its own part to
  RUN_DIR/supervisor/HOST.json, then (under an exclusive lock on the shared run directory)
  merges every part of the same job into RUN_DIR/supervisor_summary.json: the job's status
  (succeeded only if every host did), every host's faults (each naming its host), the placement
  (host -> ranks) and each host's whole part under `hosts`. The last host to finish writes the
  complete file; no host's file is ever written over another's.
- Who is being waited for: after a fault the survivors' agents wait in the rendezvous for the
  hosts of the previous round; `RendezvousWait` says every few seconds which hosts have not
  rejoined, since when, and when the rendezvous gives up (its join timeout), reading the
  rendezvous state with a client of its own (never the agent's store connection).
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import pickle
import threading
import time
from pathlib import Path
from typing import Any

from myria import rundir
from myria.errors import ConfigError, first_line
from myria.fsutil import atomic_write

PARTS_DIR = "supervisor"
WAIT_REPORT_S = 10.0   # how often a wait for hosts is reported
SPARE_UNUSED = "spare-unused"   # the status of a spare host the job ended without
EXCLUDED = "excluded"           # a host the job went on and ended without
# a job whose workers ended cleanly before training.steps (its wall-time limit, a stop signal
# sent to the workers themselves): a committed checkpoint the same command resumes from
STOPPED = "stopped"


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# -- one summary of the job --------------------------------------------------------------------
def write_part_and_merge(run_dir: Path, part: dict[str, Any]) -> Path:
    """Write this host's part of the summary, merge every part of its job into the summary."""
    import fcntl

    d = Path(run_dir) / PARTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / f"{part['host']}.json", json.dumps(part, indent=1))
    fd = open(d / ".merge.lock", "a+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rundir.write_job_summary(run_dir, merge(read_parts(run_dir, part["job"]),
                                                part["host"]))
    finally:
        fd.close()
    return Path(run_dir) / rundir.SUPERVISOR_SUMMARY


def read_parts(run_dir: Path, job: str) -> dict[str, dict]:
    """host -> its supervisor's part of the summary, for the parts of job `job`."""
    out = {}
    for p in sorted((Path(run_dir) / PARTS_DIR).glob("*.json")):
        try:
            s = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if s.get("job") == job:
            out[s.get("host", p.stem)] = s
    return out


def merge(parts: dict[str, dict], writer: str) -> dict[str, Any]:
    """The job's summary from its hosts' parts: a part at the top level (the fields a one-host
    summary has: wall time, ETTR), with the job-wide fields over it. That part is the writer's
    when the writer was in the job's last round, else that of the host of the last round that
    trained furthest: a host the job went on without (excluded, a spare left unused) wrote
    only its own view, however late it wrote."""
    last_round = [h for h, p in parts.items() if p.get("status") not in (EXCLUDED, SPARE_UNUSED)]
    head = writer if writer in last_round or not last_round else \
        max(sorted(last_round), key=lambda h: parts[h].get("final_step", 0))
    top = dict(parts[head])
    statuses = {h: p.get("status") for h, p in parts.items()}
    # the job succeeded when a host of its last round trained to the end: hosts it went on
    # without (lost, cut off, drained, spares) keep their own status under host_status
    done = [p for p in parts.values() if p.get("status") == "succeeded" and
            p.get("final_step", 0) >= p.get("target_steps", 0)]
    stopped = [p for p in parts.values() if p.get("status") == STOPPED]
    bad = [s for s in statuses.values()
           if s not in ("succeeded", STOPPED, SPARE_UNUSED, EXCLUDED)]
    top["status"] = "succeeded" if done else STOPPED if stopped and not bad else \
        bad[0] if bad else "failed"
    top["final_step"] = max(p.get("final_step", 0) for p in parts.values())
    top["restarts"] = max(p.get("restarts", 0) for p in parts.values())
    top["faults"] = sorted((dict(f, host=h) for h, p in parts.items()
                            for f in p.get("faults", [])), key=lambda f: f.get("fault_at", 0))
    top["blocklist"] = sorted({b for p in parts.values() for b in p.get("blocklist", [])})
    top["placement"] = {h: p.get("ranks", []) for h, p in sorted(parts.items())}
    top["host_status"] = statuses
    top["hosts"] = parts
    top["written_by"] = writer
    return top


def job_status(run_dir: Path, job: str) -> int:
    """Print job `job`'s outcome from the run directory's merged summary in one line; 0 when
    it succeeded or stopped cleanly as asked (`STOPPED`: its wall-time limit), else 1.
    The batch script's exit: Slurm's final state of the job is then the job's, not its worst
    node's (a node drained or cut off leaves with a non-zero exit while the job trains to its
    end on the others)."""
    if not job:
        raise ConfigError("--job-status needs --rdzv-id JOB (the job whose outcome to print; "
                          "the Slurm script's is slurm-$SLURM_JOB_ID)")
    s: dict = {}
    # the newest job's summary, else the one kept for each job (an older job of the run)
    for f in (Path(run_dir) / rundir.SUPERVISOR_SUMMARY, rundir.job_summary_file(run_dir, job)):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if s.get("job") == job:
            break
    if s.get("job") != job:
        print(f"myria: job {job}: no summary of it in {run_dir}"
              + (f" (the newest is of job {s.get('job')!r})" if s.get("job") else ""))
        return 1
    status = sorted((s.get("host_status") or {s.get("host", "?"): s.get("status")}).items())
    ok = ("succeeded", STOPPED)
    ran = ", ".join(h for h, st in status if st in ok)
    others = ", ".join(f"{h}: {st}" for h, st in status if st not in ok)
    where = (f"on {ran}" + (f" ({others})" if others else "")) if ran else f"({others})"
    print(f"myria: job {job} {s.get('status')} at step {s.get('final_step')}/"
          f"{s.get('target_steps', '?')} {where}")
    return 0 if s.get("status") in ok else 1


def moved_on_without(run_dir: Path, job: str, host: str) -> str:
    """Why job `job` went on without `host` (a newer round recorded in the run directory's
    fence without it: the host was cut off), or ""."""
    try:
        f = json.loads((Path(run_dir) / rundir.FENCE).read_text())
    except (OSError, ValueError):
        return ""
    if f.get("job") != job or host in f.get("hosts", []) or not f.get("generation"):
        return ""
    return (f"the job went on without this host (round {f['generation']} on "
            f"{', '.join(f.get('hosts', []))} since {_hms(f.get('time', 0))}); its workers "
            "were fenced off the run directory")


FENCED_EXIT_S = 5.0   # how long a fenced-off host's workers get to stop on the fence themselves


def await_fenced_exit(run_dir: Path, pids: list[int]) -> list[int]:
    """When the job went on from the round this host's workers (`pids`) run (myria.rundir.fenced
    with the round its supervisor gave them), wait up to FENCED_EXIT_S for them to stop on the
    fence themselves, each saying so in its log (they look every myria.rundir.FENCE_POLL_S), so
    that none is killed by its own agent first because a sibling stopped; returns the pids
    still running."""
    from myria.fsutil import pid_alive

    end = time.time() + FENCED_EXIT_S
    while (alive := [p for p in pids if pid_alive(p)]) and rundir.fenced(run_dir) and \
            time.time() < end:
        time.sleep(0.1)
    return alive


# -- the rendezvous wait -----------------------------------------------------------------------
def members(agent) -> list[str]:
    """The hosts of the agent's current rendezvous round (torch's c10d dynamic rendezvous)."""
    try:
        state = agent._rdzv_handler._state_holder.state
        return sorted({n.addr for n in state.participants})
    except AttributeError:
        return []


def waiting_without_room(handler) -> tuple[bool, list[str]]:
    """Whether the current round of torch's c10d rendezvous is complete with every place taken
    (as the rendezvous store holds it now), and the hosts left in its wait list then, moved to
    its redundancy list (their names).

    torch moves a host to the redundancy list (a spare: it waits without a deadline and is
    taken in when a member drops out) only when it arrives after a round completed full. A
    host already in the wait list when a new round fills up without it (a spare, or a host
    back from a partition, racing the members back into the round after a restart) stays
    there, and `num_nodes_waiting` counts it: every member's agent restarts the workers for
    it, the next round fills up without one host again, and the job restarts round after round
    until that host's join times out. A host waiting while the round is full is therefore made
    a spare here, as if it had arrived after the round completed. The change is a
    compare-and-set of the rendezvous state (lost, and tried again at the next call, when
    another host wrote first). A round with a member whose keep-alive stopped has room (the
    read drops that member), and its waiting hosts are left to join the next one.

    The handler's state cache is turned off: a state read up to a second ago can predate the
    round's completion, and the decision to restart the job must not rest on it."""
    with handler._heartbeat_lock:
        holder = handler._state_holder
        holder._cache_duration = 0
        holder.sync()
        state = holder.state
        full = state.complete and not state.closed and \
            len(state.participants) >= handler.settings.max_nodes
        if not (full and state.wait_list):
            return full, []
        moved = sorted({n.addr for n in state.wait_list})
        state.redundancy_list.update(state.wait_list)
        state.wait_list.clear()
        holder.mark_dirty()
        return full, moved if holder.sync() else []


EXIT_STORE_LOST = 69   # sysexits' EX_UNAVAILABLE: the job's rendezvous store (first node) is gone


def close_rendezvous(agent) -> None:
    """The job trained to its end: close its rendezvous, so that a spare host waiting in it
    leaves now (torch's agent does not close it; torchrun's launcher does, after the agent).
    Without this a spare that serves the store itself (the first node, when it joined last)
    would wait out the rendezvous timeout, holding the job's allocation."""
    try:
        agent._rdzv_handler.set_closed()
    except Exception as e:   # the store already gone: a spare's wait ends on its own
        logging.getLogger("myria.supervisor").debug("closing the rendezvous: %s", e)


def job_ended(run_dir: Path, job: str, wait_s: float = 2.0) -> str:
    """How job `job` trained to its end, by its hosts' parts of the summary, or "". A host
    writes its part before it exits, and the first node's exit takes the rendezvous store
    with it: a spare that then finds the store gone looks here (for up to `wait_s`, a shared
    file system's lag) before it calls the store lost."""
    end = time.time() + wait_s
    while True:
        done = [(h, p) for h, p in read_parts(run_dir, job).items()
                if p.get("status") == "succeeded" and p.get("target_steps") and
                p.get("final_step", 0) >= p["target_steps"]]
        if done:
            return f"{done[0][0]} trained it to step {done[0][1]['final_step']}"
        if time.time() >= end:
            return ""
        time.sleep(0.25)


def gave_up_gathering(run_dir: Path, job: str, host: str, wait_s: float = 2.0) -> str:
    """Which other host of job `job` gave up because the job's hosts never gathered (its part
    of the summary says "rendezvous-failed"), or "": when the first node gives up so, its exit
    takes the rendezvous store with it, and a host that then finds the store gone is seeing
    that, not a lost node (waits up to `wait_s` for a shared file system's lag)."""
    end = time.time() + wait_s
    while True:
        who = sorted(h for h, p in read_parts(run_dir, job).items()
                     if h != host and p.get("status") == "rendezvous-failed")
        if who or time.time() >= end:
            return ", ".join(who)
        time.sleep(0.25)


def hosts_at(hosts: list[str], address: str) -> list[str]:
    """Which of `hosts` (names) is at `address` (the rendezvous store's), by name or by what
    the name resolves to; [address] when none is known to be."""
    import socket

    for h in hosts:
        try:
            if h == address or address in {a[4][0] for a in socket.getaddrinfo(h, None)}:
                return [h]
        except OSError:
            continue
    return [address] if address else []


def store_lost(endpoint: str) -> str:
    """Why the job cannot go on when its rendezvous store (`endpoint`, on the job's first
    node) does not answer, or "" when it does: torch's c10d rendezvous keeps its state in
    that one store, with no replica to fail over to."""
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return ""
    except (OSError, ValueError) as e:
        return (f"the rendezvous store at {endpoint} (the job's first node) does not answer "
                f"({getattr(e, 'strerror', None) or e}): that node is lost or this host is cut "
                "off from it, and the job's rendezvous lives only there")


def left_round(agent, hosts: list[str]) -> list[str]:
    """Which of `hosts` (the current round's) are no longer participants of the rendezvous:
    torch's c10d rendezvous drops a host whose keep-alive stopped (lost or cut off)."""
    try:
        holder = agent._rdzv_handler._state_holder
        holder.sync()
        now = {n.addr for n in holder.state.participants}
    except Exception:
        return []
    return [h for h in hosts if h not in now]


def _read_state(store, run_id: str):
    key = "torch.rendezvous." + run_id
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return pickle.loads(base64.b64decode(raw))
    except Exception:
        return None


class RendezvousWait(threading.Thread):
    """Logs, every WAIT_REPORT_S until stopped, which hosts of the previous round have not
    rejoined the rendezvous, since when and until when it waits for them."""

    def __init__(self, log: logging.Logger, endpoint: str, run_id: str, host: str,
                 expected: list[str], since: float, join_timeout_s: float,
                 min_nodes: int) -> None:
        super().__init__(daemon=True, name="myria-rdzv-wait")
        self.log, self.endpoint, self.run_id, self.host = log, endpoint, run_id, host
        self.spare_said = False
        self.expected, self.since = expected, since
        self.started_wait = time.time()
        self.until = self.started_wait + join_timeout_s
        self.timeout_s, self.min_nodes = join_timeout_s, min_nodes
        self.stop_event = threading.Event()
        self.missing: list[str] = []

    def stop(self) -> None:
        self.stop_event.set()

    def _store(self):
        return store_client(self.endpoint, 5.0)

    def run(self) -> None:
        store = None
        while not self.stop_event.wait(min(WAIT_REPORT_S, 3.0) if store is None
                                       else WAIT_REPORT_S):
            joined: list[str] | None = None
            spare = False
            try:
                store = store or self._store()
                state = _read_state(store, self.run_id)
                if state is not None:
                    joined = sorted({n.addr for n in (*state.participants, *state.wait_list)})
                    spare = state.complete and self.host in \
                        {n.addr for n in state.redundancy_list}
            except Exception as e:  # the rendezvous host itself may be the one lost
                store = None
                self.log.warning("WAITING for the rendezvous at %s since %s: unreachable (%s); "
                                 "gives up at %s (training.init_timeout_s %g s)", self.endpoint,
                                 _hms(self.since), first_line(e, 120),
                                 _hms(self.until), self.timeout_s)
                continue
            if self.stop_event.is_set():
                break
            if joined is None:
                continue
            if spare:
                if not self.spare_said:
                    self.spare_said = True
                    self.log.info("SPARE: %s waits in the rendezvous as a spare host: the round "
                                  "is complete with %s; it steps in when a host is lost",
                                  self.host, ", ".join(sorted(n.addr for n in
                                                              state.participants)))
                continue
            self.missing = [h for h in self.expected if h not in joined]
            if not self.expected and len(joined) < self.min_nodes:
                self.log.warning("WAITING for %d more host(s) to join the rendezvous since %s "
                                 "(%d of %d: %s); it gives up at %s (training.init_timeout_s "
                                 "%g s)", self.min_nodes - len(joined), _hms(self.since),
                                 len(joined), self.min_nodes, ", ".join(joined) or "none",
                                 _hms(self.until), self.timeout_s)
            elif self.missing:
                self.log.warning(
                    "WAITING for host(s) %s to rejoin (in the previous round, silent since %s); "
                    "%d of %d host(s) needed have joined (%s); the rendezvous gives up at %s "
                    "(training.init_timeout_s %g s) unless a spare host joins",
                    ", ".join(self.missing), _hms(self.since), len(joined), self.min_nodes,
                    ", ".join(joined) or "none", _hms(self.until), self.timeout_s)


# -- a host's link ------------------------------------------------------------------------------
LINK_PROBE_BYTES = 128 * 1024
LINK_SLOW_FRACTION = 0.25   # below this share of its own earlier bandwidth: a degraded link
LINK_SLOW_PROBES = 3        # in a row, so one slow probe on a loaded host is not a verdict


class LinkProbe:
    """This host's link to the rendezvous host, measured by the supervisor: a LINK_PROBE_BYTES
    value written to and read back from the rendezvous store (both directions of the NIC),
    every call. A link whose bandwidth falls below LINK_SLOW_FRACTION of its own median over
    the first probes, LINK_SLOW_PROBES times in a row, is degraded (a slow NIC, a bad cable,
    a throttled port): `probe()` returns the verdict once. The rendezvous host's own probe
    does not cross its NIC and is not taken."""

    def __init__(self, endpoint: str, job: str, host: str) -> None:
        self.endpoint, self.key = endpoint, f"myria/link/{job}/{host}"
        self.history: list[float] = []
        self.slow_in_row = 0
        self.reported = False
        self.store = None
        self.payload = b"\0" * LINK_PROBE_BYTES

    def probe(self) -> str:
        import socket as _socket

        host, _, port = self.endpoint.rpartition(":")
        try:
            if self.store is None:
                import torch.distributed as dist

                if host in ("127.0.0.1", "localhost") or host in \
                        {a[4][0] for a in _socket.getaddrinfo(_socket.gethostname(), None)}:
                    return ""   # the rendezvous host itself
                self.store = dist.TCPStore(host, int(port), is_master=False,
                                           wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=10))
            t = time.perf_counter()
            self.store.set(self.key, self.payload)
            self.store.get(self.key)
            mbs = 2 * LINK_PROBE_BYTES / (time.perf_counter() - t) / 1e6
        except Exception:
            self.store = None
            return ""
        self.history.append(mbs)
        base = sorted(self.history[:3])[len(self.history[:3]) // 2]
        if len(self.history) <= 3 or self.reported:
            return ""
        self.slow_in_row = self.slow_in_row + 1 if mbs < LINK_SLOW_FRACTION * base else 0
        if self.slow_in_row < LINK_SLOW_PROBES:
            return ""
        self.reported = True
        recent = self.history[-LINK_SLOW_PROBES:]
        return (f"{sum(recent) / len(recent):.2f} MB/s to the rendezvous host over the last "
                f"{LINK_SLOW_PROBES} probes, {sum(recent) / len(recent) / base:.0%} of its "
                f"earlier {base:.1f} MB/s")


def store_client(endpoint: str, timeout_s: float = 10.0):
    """A client of the rendezvous store at `endpoint` (HOST:PORT), served by the job's first
    node."""
    import torch.distributed as dist

    host, _, port = endpoint.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
