"""Files and folders named after the process that made them (``<prefix><pid>.<pid namespace>``),
so that a later process can tell the ones whose maker is gone (killed before it could remove
them) and remove them. A maker is judged only inside its own pid namespace: containers sharing
/tmp or /dev/shm see other pids."""

from __future__ import annotations

import os

from rollout_fleet.adapters.shared.processes import pid_namespace, process_alive


def maker_tag(prefix: str) -> str:
    """The start of a name this process makes: ``<prefix><pid>.<pid namespace>``."""
    return f"{prefix}{os.getpid()}.{pid_namespace()}"


def maker_of(name: str, prefix: str) -> int | None:
    """The pid in a name from ``maker_tag(prefix)`` made in this pid namespace; else None."""
    if not name.startswith(prefix):
        return None
    pid, _, namespace = name[len(prefix):].split("-", 1)[0].partition(".")
    return int(pid) if pid.isdigit() and namespace == pid_namespace() else None


def orphans(parent: str, prefix: str) -> list[os.DirEntry]:
    """This user's entries of ``parent`` named with ``prefix`` whose maker is gone. A live
    maker's are left out, whoever it is."""
    found = []
    for entry in os.scandir(parent) if os.path.isdir(parent) else ():
        maker = maker_of(entry.name, prefix)
        if maker is None or process_alive(maker):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                found.append(entry)
        except FileNotFoundError:
            pass  # its maker's clean-up, or another sweep, got there first
    return found
