"""myria.fsutil: the file helpers every writer of state uses."""

import os
import subprocess
import sys
import zlib

import pytest

from myria import fsutil


def test_atomic_write_all_or_nothing(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    fsutil.atomic_write_json(p, {"a": 1})
    fsutil.atomic_write(p, b"\x00\x01")           # bytes replace the text
    assert p.read_bytes() == b"\x00\x01"
    fsutil.atomic_write(p, "text\n", durable=False)
    assert p.read_text() == "text\n"

    def fail(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)       # the rename fails: the old file stays whole
    with pytest.raises(OSError):
        fsutil.atomic_write_json(p, {"b": 2})
    assert p.read_text() == "text\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]  # no temporary left


def test_link_or_copy_and_crc(tmp_path):
    src, dst = tmp_path / "a.bin", tmp_path / "b.bin"
    data = os.urandom(3 << 10)
    src.write_bytes(data)
    dst.write_text("stale")
    assert fsutil.link_or_copy(src, dst) == "link"   # same file system: a hard link
    assert os.path.samefile(src, dst)
    assert fsutil.file_crc32(dst, chunk=1000) == (f"{zlib.crc32(data):08x}", len(data))


def test_torch_free():
    """Writers that must stay light (the supervisor, `myria --help`) import it at the top."""
    out = subprocess.run([sys.executable, "-c", "import myria.fsutil, sys; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_pid_alive_sees_a_zombie_as_dead():
    """A child that exited but was not reaped yet is a zombie: not alive, so a lock or a save
    directory it owned can be taken over; a running process is alive."""
    import time

    assert fsutil.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while fsutil.pid_alive(child.pid) and time.time() < deadline:   # exits, stays unreaped
        time.sleep(0.05)
    assert not fsutil.pid_alive(child.pid)
    assert os.path.exists(f"/proc/{child.pid}")   # still a zombie, not yet reaped
    child.wait()
    assert not fsutil.pid_alive(child.pid)


def test_proc_stat_reads_past_a_name_with_spaces_and_parentheses(tmp_path):
    """/proc/PID/stat's command name may hold ") (": the fields start after its last ")"."""
    import time

    odd = tmp_path / "a) (b"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.time() + 30
        while time.time() < deadline and ") (" not in open(f"/proc/{child.pid}/stat").read():
            time.sleep(0.05)   # the name is the exec'd file's once the exec is done
        fields = fsutil.proc_stat(child.pid)
        assert fields[0] in "RS" and int(fields[1]) == os.getpid(), fields   # state, parent
        assert fsutil.proc_stat()[0] == "R"          # this process, running
    finally:
        child.kill()
        child.wait()
    assert fsutil.proc_stat(child.pid) is None       # reaped: gone
