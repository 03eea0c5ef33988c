"""The swap engine's folders: checked before use, removed on SIGTERM, and reclaimed from killed runs.

Also whether a folder takes O_DIRECT (:func:`probe_direct`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import stat
import threading


from .aio_requests import AioError, human_bytes
from .swap_layout import ALIGNMENT

log = logging.getLogger("zinf")


def validate_folder(folder: str | None, needed_bytes: int) -> None:
    """Fail early, naming the option ``nvme_path``, if ``folder`` cannot hold ``needed_bytes`` of swap.

    Raises :class:`AioError` if the folder is missing, not a folder, not
    writable, or on a filesystem with less than ``needed_bytes`` free.
    """
    if not folder:
        raise AioError("NVMe offload needs the option nvme_path: a folder on a fast local disk")
    if not os.path.exists(folder):
        raise AioError(f"nvme_path {folder!r} does not exist; create it first (mkdir -p {folder}) "
                       f"or point nvme_path at an existing folder on a fast local disk")
    if not os.path.isdir(folder):
        raise AioError(f"nvme_path {folder!r} is not a folder; point nvme_path at a folder on a fast local disk")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AioError(f"nvme_path {folder!r} is not writable by this process (uid {os.geteuid()}); "
                       f"fix its permissions or point nvme_path elsewhere")
    stats = os.statvfs(folder)
    available = stats.f_bavail * stats.f_frsize
    if available < needed_bytes:
        raise AioError(
            f"nvme_path {folder!r} is too small for the swap files: needs {human_bytes(needed_bytes)} "
            f"({needed_bytes:,} bytes), {human_bytes(available)} free ({available:,} bytes); "
            f"free space there or point nvme_path at a bigger disk"
        )



# --- SIGTERM: remove the swap folders before dying -------------------------------------
# SIGINT raises KeyboardInterrupt, so the interpreter exits and the finalizers
# run; SIGTERM's default action (torchrun's way of stopping the other ranks
# when one fails, and a scheduler's) ends the process at once, leaving every
# swap folder behind until the next start.  While a swap folder exists, a
# SIGTERM that would kill the process first removes them.

class FolderWatch:
    """The swap folders of a process's open engines, removed if a SIGTERM ends the process.

    One per process (``Runtime.swap_folders``), handed to each engine it builds;
    an engine built alone (tests, benchmarks) makes its own.  Its handler is a
    bound method, so the signal reaches the folders without an import or a
    lock; a second watch installs over a first and calls it after its own.
    """

    def __init__(self) -> None:
        self._folders: dict[int, str] = {}  # id(owner) -> the swap folder of an open engine
        self._installed = False
        self._next_handler = None  # the watch installed before this one (its handler runs after)

    def watch(self, owner: object, folder: str) -> None:
        """Remove ``folder`` if a SIGTERM ends the process while ``owner`` (an engine's state) is open."""
        self._folders[id(owner)] = folder
        self._install()

    def unwatch(self, owner: object) -> None:
        """``owner`` removed its folder itself (see :meth:`watch`)."""
        self._folders.pop(id(owner), None)

    def folders(self) -> list[str]:
        """The folders a SIGTERM would remove now."""
        return list(self._folders.values())

    def _remove_folders_then_die(self, signum, frame) -> None:
        # No locks, no joins: the signal may arrive inside any critical section.  Open
        # files of unlinked swap keys just vanish when the process ends right after.
        for folder in list(self._folders.values()):
            shutil.rmtree(folder, ignore_errors=True)
        if self._next_handler is not None:
            self._next_handler(signum, frame)  # the earlier watch's folders, then the default action
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _install(self) -> None:
        """Install the SIGTERM cleanup once, only over the default action or another watch's (a user's own
        handler is kept)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if getattr(current, "__func__", None) is FolderWatch._remove_folders_then_die:
            self._next_handler = current
            signal.signal(signal.SIGTERM, self._remove_folders_then_die)
        elif current is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._remove_folders_then_die)
        self._installed = True


# --- swap folders left by killed runs ---------------------------------------------------
# A process killed by SIGKILL or the OOM killer (or a crashed node) never runs
# its finalizer, so its swap folder, possibly hundreds of GiB, would stay under
# nvme_path forever.  Each folder's name says whose it is, so a later engine can
# tell a dead owner's folder from a live one's without any lock file.

_FOLDER_NAME = re.compile(
    r"zinf-swap-(?P<pid>\d+)-"
    r"(?:(?P<start>\d+)\.(?P<pidns>\d+)\.(?P<boot>[0-9a-f]{8})\.(?P<host>[0-9a-f]{8})-)?"
    r"[a-z0-9_]{8}"  # tempfile.mkdtemp's random part
)


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22).

    None: no such process (or no /proc).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # Field 2 (the command name, in parentheses) may itself hold spaces and parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])


def _start_seconds(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (None: no such process, or no /proc)."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def owner_tag() -> str | None:
    """``<start ticks>.<pid namespace>.<boot id>.<host>`` of this process, for its folder's name (None: no /proc).

    The pid alone does not identify a process: pids are reused, mean nothing
    in another pid namespace (a container) and nothing after a reboot or on
    another machine sharing the disk.  With the start time, namespace, boot id
    and host hash, :func:`remove_stale_folders` can tell all of these apart.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            own_pid = int(handle.read().split(b" ", 1)[0])
        # A /proc of another pid namespace (a container seeing the host's) would
        # describe other processes under our pids: then nothing can be judged.
        start = _start_ticks(os.getpid()) if own_pid == os.getpid() else None
        namespace = re.fullmatch(r"pid:\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip().replace("-", "")[:8]
    except (OSError, ValueError, IndexError):
        return None
    if start is None or namespace is None or not re.fullmatch(r"[0-9a-f]{8}", boot):
        return None
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"{start}.{namespace.group(1)}.{boot}.{host}"


def _stale_reason(match: re.Match, info: os.stat_result, mine: list[str]) -> str | None:
    """Why the folder named by ``match`` belongs to no live process (None: it may, so it stays)."""
    pid = int(match["pid"])
    _, my_namespace, my_boot, my_host = mine
    if match["start"] is not None:
        if match["host"] != my_host:
            return None  # another machine sharing this disk: its processes cannot be seen from here
        if match["boot"] != my_boot:
            return "made before this machine last booted"
        if match["pidns"] != my_namespace:
            return None  # another pid namespace (a container): its pids mean other processes here
        started = _start_ticks(pid)
        if started is None:
            return f"process {pid} has exited"
        if started != int(match["start"]):
            return f"process {pid} has exited and its pid was reused"
        return None
    # Made before folder names carried the owner: judged by the pid and times alone.
    started = _start_seconds(pid)
    if started is None:
        return f"process {pid} has exited"
    # The owner started before it made the folder, and the folder's mtime is
    # no earlier than that; a process that started later reuses the pid.  2 s
    # of slack: the boot time in /proc/stat has whole seconds.
    if started > info.st_mtime + 2.0:
        return f"process {pid} has exited and its pid was reused by a process that started after the folder was made"
    return None


def tree_bytes(path: str) -> int:
    """Allocated bytes of every file under ``path`` (st_blocks: what the disk holds)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def remove_stale_folders(root: str) -> list[str]:
    """Remove the swap folders under ``root`` whose process no longer exists; return what was removed.

    Only folders named ``zinf-swap-<pid>-...``, owned by this user, are
    considered.  One whose name carries its owner (start time, pid namespace,
    boot, host; see :func:`_owner_tag`) is stale when it was made before the
    last boot, or when ``<pid>`` is gone or is now a different process (its
    start time differs).  One of another host or pid namespace is never
    removed: whether its process lives cannot be seen from here.  One without
    the owner (made by an older zinf) is stale when ``<pid>`` is gone or
    started after the folder last changed.  A live process's folder is never
    removed.  Logs a warning naming each folder removed.
    """
    mine = owner_tag()
    if mine is None:
        return []  # no /proc: nothing can be judged, nothing is removed
    mine_fields = mine.split(".")
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        reason = _stale_reason(match, info, mine_fields)
        if reason is None:
            continue
        size = tree_bytes(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)  # another engine may be removing it at the same time
        if os.path.lexists(entry.path):
            log.warning("zinf: could not remove the stale swap folder %s (%s) under nvme_path; remove it by hand",
                        entry.path, reason)
            continue
        removed.append(f"{entry.path} ({reason}; {human_bytes(size)})")
    if removed:
        log.warning("zinf: removed %d swap folder(s) under nvme_path %s left by runs that did not exit cleanly: %s",
                    len(removed), root, "; ".join(removed))
    return removed



def _swap_file_error(action: str, folder: str, err: OSError) -> AioError:
    return AioError(f"cannot {action} a swap file in {folder} (under nvme_path): "
                    f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})")


def probe_direct(folder: str) -> bool:
    """Whether the filesystem under ``folder`` accepts O_DIRECT (tmpfs does only since Linux 6.6)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(folder, "probe-o-direct")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise _swap_file_error("create", folder, err) from err
    try:
        block = mmap.mmap(-1, ALIGNMENT)  # page aligned
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise _swap_file_error("write", folder, err) from err
        finally:
            block.close()
        return True
    finally:
        os.close(fd)
        os.unlink(path)


