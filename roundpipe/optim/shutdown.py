"""The end of a rank: ``shutdown_process_group()``, a ``barrier`` and ``destroy_process_group``
that interpreter exit cannot race (docs/distributed.md, "Ending a rank").

A gloo group's worker threads outlive ``torch.distributed.destroy_process_group()``: torch's
caches keep ``DeviceMesh`` objects, and each mesh keeps its groups (``_pg_registry``). A worker
that drops the last reference to a collective's work after the main thread began finalizing
asks for the GIL to release the work's tensors, is told to exit, and the unwinding through a
``noexcept`` destructor ends in ``std::terminate`` (SIGABRT; pytorch/pytorch#190489). This
module imports ``torch.distributed`` only when called.
"""

from __future__ import annotations

import gc
import weakref


def shutdown_process_group() -> bool:
    """End this rank's process groups so that no gloo worker is left to race interpreter exit.

    Collective: every rank calls it once, at the end, in place of ``dist.barrier()`` and
    ``dist.destroy_process_group()``. For each group this rank belongs to (in creation order):
    a ``barrier``, whose work object is kept; then ``destroy_process_group()``; then the
    references torch's ``DeviceMesh`` objects keep to the destroyed groups are dropped and
    the garbage collector runs, which frees every group nothing else holds: its destructor
    joins its worker threads, with the GIL released, while the interpreter is intact.

    Returns ``True`` when every group was freed (its threads joined), ``False`` when something
    still holds one, such as a model or optimizer of its ``DTensor``s that is still alive
    (drop them first, e.g. train in a function that returns before this call). Then the kept
    barriers still make the exit safe: a gloo barrier keeps the works in flight when it was
    issued, so the works a worker may still release after this returns are the barrier and
    those, and with the barrier held here none of them is destroyed on a worker.
    A no-op returning ``True`` where torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    groups = _groups()
    try:
        barriers = [_barrier(dist, g) for g in groups]
    except BaseException:
        dist.destroy_process_group()
        raise
    ids = {id(g) for g in groups}
    refs = [weakref.ref(g) for g in groups]
    del groups  # (no other name here may hold a group: the check below would see it)
    dist.destroy_process_group()
    _drop_mesh_references(ids)
    _drop_default_arguments(ids)
    gc.collect()
    if any(r() is not None for r in refs):
        _keep_forever(barriers)
        return False
    return True


def _barrier(dist, group):
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    return work


def _groups():
    """This rank's process groups, the default one first and the others in creation order."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or [dist.group.WORLD])
    return [g for g in groups if g is not None and g is not c10d.GroupMember.NON_GROUP_MEMBER]


def _drop_mesh_references(ids):
    """Remove the destroyed groups (by ``id``) from every live ``DeviceMesh``'s registry of
    groups: torch's sharding, redistribution and topology caches keep meshes after their
    tensors are gone, and through them the groups."""
    import sys

    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(device_mesh, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return
    for obj in gc.get_objects():
        if isinstance(obj, mesh_type):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                for name in [k for k, g in registry.items() if id(g) in ids]:
                    del registry[name]


def _drop_default_arguments(ids):
    """Default arguments of torch.distributed's functions that are destroyed groups become
    ``None``: ``group=group.WORLD`` (``torch.distributed.nn.functional``, ZeRO's, the sharded
    grad scaler's) is evaluated at import, so a module first imported after
    ``init_process_group`` keeps the default group for good; imported before, it held ``None``
    (the default group, in torch.distributed's calls), which this restores."""
    import sys
    import types

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("torch.distributed") and isinstance(module, types.ModuleType):
            for obj in list(vars(module).values()):
                funcs = list(vars(obj).values()) if isinstance(obj, type) else [obj]
                for func in funcs:
                    defaults = func.__defaults__ if isinstance(func, types.FunctionType) else None
                    if defaults and any(id(d) in ids for d in defaults):
                        func.__defaults__ = tuple(None if id(d) in ids else d for d in defaults)


def _keep_forever(barriers):
    """An extra reference to each barrier work that nothing releases: were the last one
    dropped during finalization before a worker dropped its own, the worker would destroy
    the barrier, and the works it keeps, then."""
    import ctypes

    for work in barriers:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
