"""How many intra-op threads each model service takes (ONNX Runtime's `intra_op_num_threads` of
every session, torch's `set_num_threads` for the torch backend).

One service alone on a host takes the CPUs it may run on, at most MAX_THREADS. When verifier and
drafter run on one host's CPUs (`specdec serve all`), each asking for every core makes their
forwards fight for them whenever they overlap (two requests in flight, or a pre-draft running
during a verify): `split_threads` gives each a share instead. An explicit `intra_op_threads` in
[verifier] or [drafter] (or `--verifier-threads` / `--drafter-threads`) always wins.
"""

from __future__ import annotations

import os

AUTO = 0  # `intra_op_threads = 0`: let the service choose (the default)
# A decoder step is a chain of small ops: past a few threads ORT's pool costs more than it splits.
MAX_THREADS = 8


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, which a container's cpuset narrows (unlike
    `os.cpu_count`, which counts the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def alone_threads(cpus: int | None = None) -> int:
    """A model service alone on its host: every usable CPU, at most MAX_THREADS."""
    return max(1, min(cpus or usable_cpus(), MAX_THREADS))


def split_threads(verifier: int, drafter: int, cpus: int | None = None) -> tuple[int, int]:
    """Verifier and drafter threads when both run on one host's CPUs; `verifier` / `drafter` are the
    configured values (AUTO: choose; an explicit value stands). The verifier, the larger model and
    the critical path of every mode, keeps every usable CPU; the drafter takes half of them (at
    least one): a draft and a verify running at once then do not both ask for every core
    (BENCHMARKS.md, "Intra-op threads (CPU)")."""
    cpus = cpus or usable_cpus()
    return verifier or alone_threads(cpus), drafter or alone_threads(max(1, cpus // 2))


def worker_threads(total: int, workers: int) -> int:
    """Each of `workers` model workers' threads when they share `total` (AUTO: the usable CPUs), at
    least one: N one-thread forwards side by side outrun one N-thread forward under load
    (BENCHMARKS.md, "Bulk decoding")."""
    return max(1, (total or usable_cpus()) // workers)
