"""The run directory's owner lock (`myria.rundir.lock`) as the hosts of one job race for it."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest

from myria import rundir
from myria.errors import ConfigError


@pytest.mark.parametrize("job, refused", [("slurm-7", False), ("slurm-8", True)])
def test_a_host_that_finds_the_owner_record_being_written_waits_for_it(tmp_path, monkeypatch,
                                                                      job, refused):
    """A host takes over the lock of a lost one (flock taken, old record cleared, its own not
    yet written) while another host of the same job asks for it: the asker waits for the record
    and shares the lock with its job; another job is refused with the owner named."""
    for var in ("TORCHELASTIC_RUN_ID", "RANK", rundir.LOCK_ENV):
        monkeypatch.delenv(var, raising=False)
    record = {"host": "h0", "pid": 4242, "command": "train", "job": "slurm-7",
              "time": time.time()}
    fd = os.open(tmp_path / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    writer = threading.Timer(0.3, os.pwrite, (fd, json.dumps(record).encode(), 0))
    writer.start()
    try:
        if refused:
            with pytest.raises(ConfigError, match=r"in use by `myria train` \(pid 4242 on host "
                                                  r"h0"):
                rundir.lock(tmp_path, "supervise", job)
        else:
            rundir.lock(tmp_path, "supervise", job)
            assert str((tmp_path / rundir.LOCK).resolve()) not in rundir._held
    finally:
        writer.join()
        os.close(fd)
