"""Several in-process vLLM engines in one process: freeing one leaves the others running.

vLLM 0.32 `v1/engine/core.py`: `EngineCore.shutdown()` (run when an `LLM` is closed or garbage-collected) ends
with `cleanup_dist_env_and_memory()`, which destroys the process-wide model-parallel groups
(`distributed/parallel_state.py`: `destroy_model_parallel`, `destroy_distributed_environment`). With in-process
engines (VLLM_ENABLE_V1_MULTIPROCESSING=0, what collect, layers, routing and TRL's colocated mode use) every engine
of the process shares those groups, so an engine still alive then fails on its next forward with "pipeline model
parallel group is not initialized". `install()` makes that teardown wait for the last engine core of the
process: while another core lives, a shutdown frees its own engine (garbage collection) and leaves the groups
alone; the last one to shut down runs vLLM's full teardown. A new engine made afterwards initialises the groups
again, as before.

The groups an engine finds already made were made for the first engine's model: vLLM creates the expert-parallel
group only for an MoE model (`initialize_model_parallel`), and `ensure_model_parallel_initialized` leaves
existing groups as they are, so an MoE engine built while a dense one lives would find none ("expert parallel
group is not initialized"). In a one-process world (world size 1, the only case patched) the missing group is
made as vLLM makes it, of the one rank.
"""

from __future__ import annotations

import gc
import weakref

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The engine cores of this process that are built and not shut down."""


def live_engine_cores() -> int:
    """How many in-process vLLM engine cores are alive (built, not shut down) in this process."""
    return len(_LIVE)


def install() -> None:
    """Patch vLLM's EngineCore once per process (idempotent): register each core, and skip the process-wide
    teardown while another core is alive."""
    from vllm.v1.engine import core

    if getattr(core, "_teardown_waits_for_last_engine", False):
        return
    init, shutdown, cleanup = core.EngineCore.__init__, core.EngineCore.shutdown, core.cleanup_dist_env_and_memory

    def registered_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _LIVE.add(self)

    def unregistered_shutdown(self):
        _LIVE.discard(self)
        shutdown(self)

    def cleanup_unless_others_live(*args, **kwargs):
        if len(_LIVE):
            gc.collect()
            return None
        return cleanup(*args, **kwargs)

    _add_expert_group_when_missing()
    core.EngineCore.__init__ = registered_init
    core.EngineCore.shutdown = unregistered_shutdown
    core.cleanup_dist_env_and_memory = cleanup_unless_others_live
    core._teardown_waits_for_last_engine = True


def _add_expert_group_when_missing() -> None:
    """After vLLM's worker ensures the model-parallel groups, add the expert-parallel group of a one-rank world
    when the groups were made for a dense model and this engine's model is an MoE."""
    import torch
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker import gpu_worker

    ensure = gpu_worker.ensure_model_parallel_initialized

    def ensure_with_expert_group(*args, **kwargs):
        ensure(*args, **kwargs)
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        world = ps.get_world_group()
        if ps._EP is None and world.world_size == 1 and config is not None and config.model_config.is_moe:
            backend = torch.distributed.get_backend(world.device_group)
            ps._EP = ps.init_model_parallel_group([[0]], world.local_rank, backend, group_name="ep")

    gpu_worker.ensure_model_parallel_initialized = ensure_with_expert_group
