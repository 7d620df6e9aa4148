"""The open-file limit raised to what the system allows, at a process's start.

Every TCP connection is a descriptor: at the common soft limit of 1024 a reconnect storm left the broker
unable to accept anything. Raising to the hard limit costs nothing.
"""

from __future__ import annotations

from .logs import get_logger

log = get_logger()


def raise_open_files(role: str) -> tuple[int, int] | None:
    """Soft RLIMIT_NOFILE up to the hard one (logged); (before, after) soft limits, or None without one."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    error = None
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:  # e.g. above the kernel's nr_open
            error = str(e)
    after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    log.info("process.open_files", role=role, soft_before=_n(soft), soft=_n(after), hard=_n(hard),
             raised=after != soft, **({"error": error} if error else {}))
    return soft, after


def _n(limit: int) -> int | str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else limit
