"""torchair.patch_for_hcom: make torch.distributed's collectives traceable by Dynamo.

On Ascend, TorchAir rewrites the in-place c10d collectives (all_reduce, all_gather,
all_gather_into_tensor, broadcast, all_to_all_single, all_to_all) into functional collectives so
that a compiled graph contains them (as HCOM ops) instead of breaking around each call. Since
torch 2.3.1 Dynamo itself rewrites all of them except broadcast and the list form of all_to_all;
patch_for_hcom adds those two to Dynamo's table (torch.distributed._functional_collectives.
traceable_collective_remaps), so every collective TorchAir patches traces into the graph as a
functional collective, which any backend (gloo on CPU today; the npu's hccl backend once opennpu
has one) executes. Outside torch.compile nothing changes: the table is consulted by Dynamo only.
The call is idempotent.
"""

from __future__ import annotations

import torch

_REMAPPED = ("opennpu_broadcast_inplace", "opennpu_all_to_all_list_inplace")


def _group(group, fn: str):
    import torch.distributed as dist

    group = group or dist.group.WORLD
    if group is None:
        raise RuntimeError(f"{fn}: the default process group is not initialised")
    return group


def opennpu_broadcast_inplace(tensor: torch.Tensor, src: int | None = None, group=None,
                              async_op: bool = False, group_src: int | None = None):
    """dist.broadcast's parameters (Dynamo binds them by name) on the functional broadcast.
    The functional op takes the source as a global rank, as dist.broadcast's `src` is."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if async_op:
        raise AssertionError("patch_for_hcom: async_op=True cannot be traced")
    group = _group(group, "broadcast")
    if src is None:
        if group_src is None:
            raise ValueError("broadcast: one of src and group_src is required")
        src = dist.get_global_rank(group, group_src)
    return tensor.copy_(funcol.broadcast(tensor, src, group))


def opennpu_all_to_all_list_inplace(output_tensor_list, input_tensor_list, group=None,
                                    async_op: bool = False):
    """dist.all_to_all (lists of tensors, one per rank) on the functional all_to_all_single:
    the inputs are concatenated along dim 0 and the result split back into the outputs."""
    import torch.distributed._functional_collectives as funcol

    if async_op:
        raise AssertionError("patch_for_hcom: async_op=True cannot be traced")
    group = _group(group, "all_to_all")
    flat_in = torch.cat([t.reshape(t.shape[0], -1) for t in input_tensor_list])
    out = funcol.all_to_all_single(flat_in, [t.shape[0] for t in output_tensor_list],
                                   [t.shape[0] for t in input_tensor_list], group)
    for target, chunk in zip(output_tensor_list,
                             torch.split(out, [t.shape[0] for t in output_tensor_list])):
        target.copy_(chunk.reshape(target.shape))
    return None


def patch_for_hcom() -> None:
    """Add broadcast and the list all_to_all to the collectives Dynamo traces (see module doc)."""
    if not torch.distributed.is_available():
        raise RuntimeError("patch_for_hcom: this torch build has no torch.distributed")
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    # Dynamo finds a replacement by its name in this module (it imports it from there when
    # generating the guarded code), so the functions live there under their own names.
    funcol.opennpu_broadcast_inplace = opennpu_broadcast_inplace
    funcol.opennpu_all_to_all_list_inplace = opennpu_all_to_all_list_inplace
    funcol.traceable_collective_remaps[dist.broadcast] = opennpu_broadcast_inplace
    funcol.traceable_collective_remaps[dist.all_to_all] = opennpu_all_to_all_list_inplace
