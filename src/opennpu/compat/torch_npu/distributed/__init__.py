"""`torch_npu.distributed`: the torch_npu additions to torch.distributed that scripts and tests
call, over the `hccl` backend of opennpu.distributed (gloo on zero-copy CPU aliases)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from opennpu.distributed import ProcessGroupHCCL

__all__ = [
    "ProcessGroupHCCL", "is_available", "is_hccl_available", "_make_hccl_premul_sum",
    "reduce_scatter_tensor_uneven", "all_gather_into_tensor_uneven", "batch_isend_irecv",
    "gather", "gather_object",
]

batch_isend_irecv = dist.batch_isend_irecv
gather = dist.gather
gather_object = dist.gather_object


def is_available() -> bool:
    return dist.is_available()


def is_hccl_available() -> bool:
    """The hccl backend is registered whenever torch.distributed is available."""
    return dist.is_available()


def _make_hccl_premul_sum(factor):
    """ReduceOp.PREMUL_SUM with `factor` (a float or a one-element tensor): the inputs are
    multiplied by it and summed."""
    return dist._make_nccl_premul_sum(factor)


def _splits(sizes, n: int, world: int, what: str) -> list[int]:
    if sizes is None:
        if n % world:
            raise ValueError(f"{what}: dim 0 of size {n} does not split evenly over {world} ranks; "
                             "pass the split sizes")
        return [n // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or sum(sizes) != n:
        raise ValueError(f"{what}: the split sizes {sizes} must have {world} entries summing to {n}")
    return sizes


def reduce_scatter_tensor_uneven(output, input, input_split_sizes=None, op=ReduceOp.SUM, group=None,
                                 async_op=False):
    """Reduces `input` over the group and gives this rank the rows `input_split_sizes[rank]` of
    the result (dim 0 split by `input_split_sizes`, evenly when None). Runs as an all_reduce of
    a copy of `input`; completes before it returns."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = _splits(input_split_sizes, input.shape[0], world, "reduce_scatter_tensor_uneven")
    whole = input.clone()
    dist.all_reduce(whole, op=op, group=group)
    start = sum(sizes[:rank])
    output.copy_(whole[start:start + sizes[rank]].view_as(output))
    return _done(output) if async_op else None


def all_gather_into_tensor_uneven(output, input, output_split_sizes=None, group=None, async_op=False):
    """Gathers each rank's `input` (dim 0 of size `output_split_sizes[rank]`, equal when None)
    into `output`, in rank order. Runs as an all_gather of inputs padded to the largest; completes
    before it returns."""
    world = dist.get_world_size(group)
    sizes = _splits(output_split_sizes, output.shape[0], world, "all_gather_into_tensor_uneven")
    biggest = max(sizes)
    padded = input.new_zeros((biggest, *input.shape[1:]))
    padded[:input.shape[0]].copy_(input)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    start = 0
    for part, size in zip(parts, sizes):
        output[start:start + size].copy_(part[:size])
        start += size
    return _done(output) if async_op else None


def _done(tensor):
    from torch._C._distributed_c10d import _create_work_from_future

    fut = torch.futures.Future()
    fut.set_result([tensor])
    return _create_work_from_future(fut)
