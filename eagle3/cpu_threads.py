"""How many torch threads to run on a small shared CPU machine, and how idle threads wait.

torch's OpenMP threads spin-wait between parallel regions by default. On a 2-core machine that
another job also uses, a spinning thread holds a core the other thread of the same op needs, and
tiny ops (the mini world's) then run up to 10x slower than with one thread. With
`OMP_WAIT_POLICY=PASSIVE` idle threads sleep instead: measured on the 2-core machine, training the
mini LMs with 2 passive threads is as fast as with 2 spinning ones when the machine is free, and
no slower than one thread when another process keeps a core busy. The policy is read once, when
torch loads its OpenMP runtime, so `prefer_passive_wait` must run before `import torch`.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_wait() -> None:
    """Idle OpenMP threads sleep (unless the environment already chose a policy). Call before torch
    is imported; afterwards it changes nothing."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def passive_wait() -> bool:
    return os.environ.get(WAIT_POLICY, "").strip().upper() == "PASSIVE"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_threads() -> int:
    """All usable cores when idle threads sleep; otherwise the cores other processes leave free
    (spinning threads that compete with other jobs are far slower than fewer threads)."""
    cores = usable_cores()
    if passive_wait():
        return cores
    try:
        busy = os.getloadavg()[0]  # runnable processes, averaged over the last minute
    except OSError:
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def small_op_threads(threads: int) -> int:
    """Torch threads for a phase of many tiny ops (the mini world's joint vision step: a 2-layer tower on
    16 tiny images, a 128-wide LM): one when idle threads sleep, else `threads`. Waking a sleeping thread
    costs more than it gives there; measured on the 2-core machine (BENCHMARKS.md, "A CPU world that sees"),
    100 joint steps took 50 s on 2 passive threads, 39 s on 1, 28 s on 2 spinning ones."""
    return 1 if passive_wait() else threads


@contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to `n` inside the block and restored after it."""
    import torch  # only here: the rest of this module must run before torch is imported

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
