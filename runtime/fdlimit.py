"""The open-file limit raised to what the system allows, at a process's start.

Every TCP connection is a descriptor. With the common soft limit of 1024, a broker met by
more half-open connections than that (a reconnect storm, a scanner) ran out, and ZeroMQ
could accept nothing, a live peer's control session included, until they timed out. The
hard limit is what an unprivileged process may raise itself to, so nothing is lost by
asking for it; a system that refuses leaves the limit as it was (logged either way).
"""

from __future__ import annotations

from .logs import get_logger

log = get_logger()


def raise_open_files(role: str) -> tuple[int, int] | None:
    """Soft RLIMIT_NOFILE up to the hard one; logs `process.open_files`. Returns (before,
    after) soft limits, or None where the platform has no such limit."""
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
