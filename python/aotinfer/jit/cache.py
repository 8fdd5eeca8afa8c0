"""The JIT compile cache: where built objects live, and how they are published, checked and locked.

Under the cache root (``AOTINFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/aotinfer``, else
``~/.cache/aotinfer``)::

    jit/<stem>-<key>/<stem>.so      a built object (stem: scale_sm103a), key: 16 hex digits
    jit/<stem>-<key>/build.json     its sidecar: sha256 and size, what it was built from, how long
    locks/<stem>-<key>.lock         the lock a builder of that entry holds; .holder says who
    tmp/<stem>-<key>.<pid>.<rand>/  a build in progress

The key is a hash of the object's contents-to-be (sources, headers, flags, toolchain and tvm-ffi
versions, archs; see core.py), never of file times. Loading an object an unfinished or damaged
build left behind is what this layout rules out:

- an entry appears whole or not at all: its directory is built under tmp/ and renamed into jit/;
- before an object is loaded, its sha256 is checked against the sidecar, so a truncated or
  corrupted file is rebuilt, not loaded;
- one process builds an entry while others wait for it: the lock is flock(2) (``filelock``),
  which the kernel drops when its holder dies however it dies, so a killed builder leaves no
  stale lock; its half-finished tmp/ directory is removed by the next builder of that entry. A
  waiter logs one line saying whom it waits for, and gives up after AOTINFER_JIT_LOCK_TIMEOUT
  seconds (default 600) with an error naming the lock file and its holder;
- the root is created 0700 and refused when another user owns it or others may write to it:
  whoever can write there chooses the code this process runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import time
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Iterator, List, Optional

logger = logging.getLogger("aotinfer.jit")

SIDECAR = "build.json"
DEFAULT_LOCK_TIMEOUT = 600.0


class CacheDirError(RuntimeError):
    """The cache directory cannot be used safely."""


class LockTimeout(TimeoutError):
    """Another process held a JIT build lock for longer than AOTINFER_JIT_LOCK_TIMEOUT."""


def cache_root() -> Path:
    configured = os.environ.get("AOTINFER_CACHE_DIR")
    if configured:
        return Path(configured).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "aotinfer"


def open_root(create: bool = True) -> Optional[Path]:
    """The checked cache root, created 0700 if missing and ``create``; None if missing otherwise."""
    root = cache_root()
    if not root.exists():
        if not create:
            return None
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            root.mkdir(mode=0o700)
    check_dir(root)
    return root


def check_dir(path: Path) -> None:
    """Raise CacheDirError unless ``path`` is a directory of this user that no one else may write."""
    st = os.stat(path)
    where = f"aotinfer's JIT cache {path}"
    fix = " Set AOTINFER_CACHE_DIR to a directory of your own that no one else can write (mode 0700)."
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"{where} is not a directory.{fix}")
    if st.st_uid != os.geteuid():
        raise CacheDirError(f"{where} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}).{fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"{where} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); whoever writes there chooses code this process"
            f" loads.{fix}"
        )


def subdir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Entry:
    """One cache entry: ``jit/<stem>-<key>/`` with ``<stem>.so`` and its sidecar."""

    def __init__(self, root: Path, stem: str, key: str) -> None:
        self.root, self.stem, self.key = root, stem, key
        self.name = f"{stem}-{key}"
        self.dir = root / "jit" / self.name
        self.library = self.dir / f"{stem}.so"
        self.sidecar = self.dir / SIDECAR

    def read_sidecar(self) -> Optional[Dict[str, Any]]:
        try:
            with open(self.sidecar) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def problem(self) -> Optional[str]:
        """None if the object matches its sidecar; else what is wrong ('missing' if absent)."""
        if not self.dir.exists():
            return "missing"
        record = self.read_sidecar()
        if record is None:
            return f"its sidecar {self.sidecar} is missing or unreadable"
        try:
            size = self.library.stat().st_size
        except OSError:
            return f"{self.library} is missing"
        if size != record.get("size"):
            return f"{self.library} has {size} bytes, its sidecar says {record.get('size')}"
        digest = sha256(self.library)
        if digest != record.get("sha256"):
            return f"{self.library} has sha256 {digest[:16]}..., its sidecar says {str(record.get('sha256'))[:16]}..."
        return None


def entries(root: Path, stem_prefix: str = "") -> List[Entry]:
    """The entries of the cache whose stem starts with ``stem_prefix`` (unchecked), sorted."""
    jit_dir = root / "jit"
    if not jit_dir.is_dir():
        return []
    found = []
    for path in sorted(jit_dir.iterdir()):
        stem, dash, key = path.name.rpartition("-")
        if dash and stem.startswith(stem_prefix) and path.is_dir():
            found.append(Entry(root, stem, key))
    return found


def new_build_dir(entry: Entry) -> Path:
    """A fresh directory under tmp/ for building ``entry``; tmp/ lives on the cache's filesystem."""
    return Path(_mkdtemp(subdir(entry.root, "tmp"), f"{entry.name}.{os.getpid()}."))


def _mkdtemp(parent: Path, prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def remove_abandoned_builds(entry: Entry, keep: Path) -> None:
    """Remove what killed builds left in tmp/ (call with ``entry``'s lock held).

    Directories of ``entry`` go at once; those of other entries only if no one holds their lock
    (a build in progress holds it until its directory is gone).
    """
    from filelock import FileLock, Timeout

    for path in (entry.root / "tmp").iterdir():
        name = path.name.split(".")[0]
        if path == keep:
            continue
        if name == entry.name:
            _remove_abandoned(path)
            continue
        lock = FileLock(str(entry.root / "locks" / f"{name}.lock"), mode=0o600, thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            _remove_abandoned(path)
        finally:
            lock.release()


def _remove_abandoned(path: Path) -> None:
    """Remove a killed build's directory. Its compilers may live on, orphaned, and still create
    temporary files in it by its path (TMPDIR): removed in place, the directory could be refilled
    between the removal of its files and its own. Renamed first, their new files fail instead."""
    aside = path.with_name(f"{path.name}.removing")
    try:
        os.rename(path, aside)
    except OSError:  # gone already, or an earlier removal's leftover in the way: remove in place
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def publish(entry: Entry, built: Path, record: Dict[str, Any]) -> None:
    """Make directory ``built`` (holding ``<stem>.so``) the entry, with its sidecar; atomic.

    Call with the entry's lock held. A damaged entry already there is moved aside first.
    """
    library = built / entry.library.name
    record = dict(record, file=library.name, sha256=sha256(library), size=library.stat().st_size)
    with open(built / SIDECAR, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for path in (library, built / SIDECAR, built):
        _fsync(path)
    subdir(entry.root, "jit")
    if entry.dir.exists():
        aside = Path(_mkdtemp(entry.root / "tmp", f"{entry.name}.replaced."))
        os.rename(entry.dir, aside / "old")
        os.rename(built, entry.dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(built, entry.dir)
    _fsync(entry.dir.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_timeout() -> float:
    text = os.environ.get("AOTINFER_JIT_LOCK_TIMEOUT", "")
    try:
        return float(text) if text else DEFAULT_LOCK_TIMEOUT
    except ValueError:
        raise ValueError(f"AOTINFER_JIT_LOCK_TIMEOUT must be a number of seconds, got {text!r}") from None


@contextlib.contextmanager
def locked(entry: Entry, what: str) -> Iterator[bool]:
    """Hold the build lock of ``entry``; ``what`` ('scale for sm_103a') names the build for others.
    Yields whether another process held it first (this one waited)."""
    from filelock import FileLock, Timeout

    path = subdir(entry.root, "locks") / f"{entry.name}.lock"
    holder = path.with_suffix(".holder")
    lock = FileLock(str(path), mode=0o600, thread_local=False)
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waited = True
        logger.warning("aotinfer: waiting for %s (lock %s)", _describe_holder(holder), path)
        timeout = lock_timeout()
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise LockTimeout(
                f"aotinfer: gave up after {timeout:g} s waiting for the JIT build lock {path}, held by"
                f" {_describe_holder(holder)}. AOTINFER_JIT_LOCK_TIMEOUT sets how long to wait."
            ) from None
    try:
        _write_json(holder, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what})
        yield waited
    finally:
        lock.release()


def _describe_holder(holder: Path) -> str:
    try:
        with open(holder) as f:
            info = json.load(f)
        pid, host, since, what = info["pid"], info["host"], float(info["since"]), info["what"]
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
    text = f"process {pid} on {host}, building {what} for {time.time() - since:.0f} s"
    if host == socket.gethostname() and not _alive(pid):
        # The kernel frees an flock when its holder exits, so the lock is held by someone else
        # (a process that inherited it) or this filesystem's locks are not what they claim.
        text += f" (process {pid} has exited; whatever holds the lock now is not a builder of ours)"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
