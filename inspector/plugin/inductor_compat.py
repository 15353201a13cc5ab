"""torch Inductor's faults that compiled hooks bring out, mended in the process the plugin runs in. The
one module that touches Inductor's private internals (checked against torch 2.13); a leaf, as
``vllm_compat`` and ``vllm_process`` are."""

from __future__ import annotations

import functools
import os

_PATCHED_FLAG = "_inspector_patched"
# what the mends change in compiled code: part of the compile caches' keys, so that graphs compiled
# without them are not loaded
COMPILE_KEY = "inductor-mutation-renames"
CACHE_DIR_VAR = "TORCHINDUCTOR_CACHE_DIR"


def keep_reads_after_the_writes_they_follow() -> None:
    """Inductor's CPU backend, to fuse two loops of different shapes, works out one loop's memory
    reads again (``SchedulerNode.recompute_size_and_body``) but puts back the renames that order a read
    after an in-place write only where the node had a hand-made dependency too. A read of a buffer
    that an extern kernel fills in place (vLLM's CPU linear layers, ``onednn_mm`` into ``torch.empty``)
    then no longer waits for that kernel: on a Glm4-MoE, a hook on one block's output got the next
    block's router logits scheduled before the matmul that writes them, and the engine read
    uninitialised memory. Patched: the renames are put back always (renaming is idempotent)."""
    try:
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:  # an Inductor without this scheduler: nothing of it to mend
        return
    recompute = getattr(SchedulerNode, "recompute_size_and_body", None)
    if recompute is None or getattr(recompute, _PATCHED_FLAG, False):
        return

    @functools.wraps(recompute)
    def recompute_size_and_body(self, *args, **kwargs):
        recompute(self, *args, **kwargs)
        self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    setattr(recompute_size_and_body, _PATCHED_FLAG, True)
    SchedulerNode.recompute_size_and_body = recompute_size_and_body
    _cache_mended_graphs_apart()


def _cache_mended_graphs_apart() -> None:
    """Inductor's own cache of compiled code (in use where vLLM's compile cache is off, which otherwise
    names a directory keyed by ``COMPILE_KEY``) is keyed by torch's sources, not by this mend: code compiled
    before it would be loaded again. Unless the user named a directory, mended code gets one of its own."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get(CACHE_DIR_VAR)
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):  # torch's default
        os.environ[CACHE_DIR_VAR] = os.path.join(default_cache_dir(), COMPILE_KEY)
