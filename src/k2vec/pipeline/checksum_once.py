"""Each input of a finished job hashed once, not once per output.

When a job ends, Snakemake's metadata step (`finished` of its persistence class) writes one record per output,
and for each record it hashes every input up to `max-checksum-file-size` again (snakemake/snakemake#4240): a
batch engine job's bundle 6 times, the report's ~66 MB of results and goldens 13 times (0.6 s on the 2-core VM),
all in Snakemake's own process, while no other job can start or finish. `install` wraps `finished` so that during
one call each file's checksum is computed once and reused for the other records; what is recorded is unchanged
(the inputs of an ended job do not change while its records are written). Where the installed Snakemake has no
such step or no `_IOFile.checksum` coroutine, nothing is wrapped and Snakemake runs as it ships.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

_memo: contextvars.ContextVar[dict | None] = contextvars.ContextVar("k2vec_checksum_memo", default=None)
_WRAPPED = "__k2vec_checksum_once__"


def _targets():
    """(persistence class, IOFile class) of the installed Snakemake, or None where its shape is not the known one."""
    try:
        import snakemake.io
        import snakemake.persistence
    except ImportError:
        return None
    persistence = getattr(snakemake.persistence, "PersistenceBase", None) or getattr(
        snakemake.persistence, "Persistence", None)
    iofile = getattr(snakemake.io, "_IOFile", None)
    if persistence is None or iofile is None:
        return None
    if not (inspect.iscoroutinefunction(getattr(persistence, "finished", None))
            and inspect.iscoroutinefunction(getattr(iofile, "checksum", None))):
        return None
    return persistence, iofile


def install() -> bool:
    """Wrap Snakemake's metadata step as the module docstring says; True where it is wrapped (now or before)."""
    targets = _targets()
    if targets is None:
        return False
    persistence, iofile = targets
    if getattr(persistence.finished, _WRAPPED, False):
        return True
    finished, checksum = persistence.finished, iofile.checksum

    @functools.wraps(checksum)
    async def checksum_once(self, *args, **kwargs):
        memo = _memo.get()
        if memo is None:
            return await checksum(self, *args, **kwargs)
        key = (str(self), args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = await checksum(self, *args, **kwargs)
        return memo[key]

    @functools.wraps(finished)
    async def finished_once(self, *args, **kwargs):
        token = _memo.set({})
        try:
            return await finished(self, *args, **kwargs)
        finally:
            _memo.reset(token)

    setattr(checksum_once, _WRAPPED, True)
    setattr(finished_once, _WRAPPED, True)
    iofile.checksum, persistence.finished = checksum_once, finished_once
    return True
