"""Files and folders that only their owner reads, whatever the umask: the disk
tier's blocks hold every prompt's token ids, and its key names them.

Modes are set explicitly after creation (os.open and os.mkdir apply the umask,
which may take bits away but also leaves group and other bits it does not mask)."""
from __future__ import annotations

import os
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


def make_dir(path: Path) -> None:
    """One folder, 0700 when made now."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)


def make_dirs(path: Path) -> None:
    """path and every missing folder above it, 0700; path itself is made 0700 if it was not."""
    for p in reversed([p for p in [path, *path.parents] if not p.exists()]):
        make_dir(p)
    os.chmod(path, DIR_MODE)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def write_private(path: Path, *parts, exist_ok: bool = False) -> None:
    """A new 0600 file holding parts. An existing file is FileExistsError, or left as it is (exist_ok)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        if exist_ok:
            return
        raise
    try:
        os.fchmod(fd, FILE_MODE)
        for part in parts:
            _write_all(fd, part)
    finally:
        os.close(fd)


def private(entry: os.DirEntry, mode: int) -> os.stat_result:
    """The entry's stat; one open to the group or others (an older ridge's) is made `mode`."""
    st = entry.stat()
    if st.st_mode & 0o777 != mode:
        os.chmod(entry.path, mode)
    return st


def remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def load_key(path: Path, size: int) -> tuple[bytes, bool]:
    """A secret of `size` random bytes kept in path (0600), made when missing or not a key;
    -> (key, whether it was made now). Processes starting at once agree on one key."""
    for _ in range(3):
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = b""
        if len(key) == size:
            os.chmod(path, FILE_MODE)
            return key, False
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        remove_quietly(tmp)
        write_private(tmp, os.urandom(size))
        try:
            if key:
                os.replace(tmp, path)  # not a key: replaced
            else:
                os.link(tmp, path)  # fails if another process made one meanwhile: read theirs
        except FileExistsError:
            continue
        finally:
            remove_quietly(tmp)
        return path.read_bytes(), True
    raise OSError(f"cannot make the key {path}")
