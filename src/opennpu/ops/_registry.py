"""Bookkeeping shared by the op modules: which ops are differentiable and how.

tests/test_registry.py walks torch.ops.npu and requires every op to appear in exactly one of
these tables, so a new op cannot ship without a decision about its gradient.
"""

from __future__ import annotations

import functools

import torch

# op name -> "autograd" (a formula is registered) or the reason it has none.
DIFFERENTIABILITY: dict[str, str] = {}


def _named_tensors(schema, args, kwargs):
    """(argument name, tensor) for every tensor an op call received, tensor lists as name[i]."""
    names = [a.name for a in schema.arguments]
    bound = list(zip(names, args)) + list(kwargs.items())
    for name, value in bound:
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{name}[{i}]", item


def check_one_device(op: str, schema, args, kwargs, host_args=()) -> None:
    """All tensors of a call share one device, 0-dim CPU tensors aside (as PyTorch's own ops
    allow). The dispatcher picks the kernel of the highest-priority device among the arguments
    (meta, then npu, then CPU), so a mixed call lands in a kernel that would otherwise allocate on
    the first argument's device and read the others' bytes as if they were its own. `host_args`
    name arguments that may be CPU tensors beside device ones (lengths an op reads on the host,
    as ATB's context_lens / seq_len)."""
    reference = None
    for name, t in _named_tensors(schema, args, kwargs):
        if t.device.type == "cpu" and (t.dim() == 0 or name in host_args):
            continue
        if reference is None:
            reference = (name, t.device)
        elif t.device != reference[1]:
            raise RuntimeError(
                f"{op}: argument '{name}' must be on the device of '{reference[0]}' "
                f"({reference[1]}), but got {t.device}")


def register_fake(qualname: str, host_args=()):
    """torch.library.register_fake, with the one-device check in front of the shape math: the
    fake kernel also serves meta tensors, where a device mix would otherwise give outputs on the
    first argument's device (and, with the other arguments real CPU tensors, garbage)."""
    ns_name, _, overload = qualname.partition(".")
    namespace, name = ns_name.split("::")
    schema = getattr(getattr(torch.ops, namespace), name)
    schema = getattr(schema, overload or "default")._schema

    def decorator(fake):
        @functools.wraps(fake)
        def checked(*args, **kwargs):
            check_one_device(name, schema, args, kwargs, host_args)
            return fake(*args, **kwargs)

        torch.library.register_fake(qualname, checked)
        return fake

    return decorator


def register_autograd(name: str, backward, setup_context) -> None:
    torch.library.register_autograd(f"npu::{name}", backward, setup_context=setup_context)
    DIFFERENTIABILITY[name] = "autograd"


def mark_backward_op(name: str, forward: str) -> None:
    """`name` computes the gradient of `forward`; differentiating it again raises a clear error."""

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{name}: double backward (the gradient of the gradient of {forward}) is not "
            "supported by opennpu"
        )

    packet = getattr(torch.ops.npu, name)
    schema = packet.default._schema
    if any(arg.kwarg_only and isinstance(arg.type, (torch.TensorType, torch.OptionalType))
           for arg in schema.arguments):
        # register_autograd refuses keyword-only tensors (npu_fusion_attention_grad has them):
        # an Autograd kernel that runs the op below autograd and ties its outputs to a node
        # whose backward raises gives the same behaviour.
        _register_raising_autograd_kernel(packet, backward)
    else:
        torch.library.register_autograd(f"npu::{name}", backward, setup_context=setup_context)
    DIFFERENTIABILITY[name] = f"backward of {forward}; double backward not supported"


def _register_raising_autograd_kernel(packet, backward) -> None:
    class _NoDoubleBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n_inputs, *tensors):
            return tuple(t.detach() for t in tensors[n_inputs:])

        @staticmethod
        def backward(ctx, *grads):
            backward(ctx, *grads)

    qualname = packet.default._schema.name

    @torch.library.impl(qualname, "Autograd")
    def _autograd_kernel(*args, **kwargs):
        with torch._C._AutoDispatchBelowAutograd():
            result = packet(*args, **kwargs)
        needs_grad = [t for t in (*args, *kwargs.values())
                      if isinstance(t, torch.Tensor) and t.requires_grad]
        if not (torch.is_grad_enabled() and needs_grad):
            return result
        return _NoDoubleBackward.apply(len(needs_grad), *needs_grad, *result)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype of the kernels: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accepts_input_keyword(fn):
    """Lets a wrapper whose first parameter is `self` also take it as `input=`, as torch_npu's
    Python bindings do (its own tests call `torch_npu.fast_gelu(input=x)`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "input" in kwargs:
            kwargs["self"] = kwargs.pop("input")
        return fn(*args, **kwargs)

    return wrapper


def mark_not_differentiable(name: str, reason: str, namespace: str = "npu") -> None:
    """`name` has no gradient (torch_npu registers none either): outputs computed from inputs
    that require grad carry a node whose backward raises a clear error, instead of silently
    giving no gradient. Ops outside torch.ops.npu (`namespace`, e.g. "atb") are recorded in
    DIFFERENTIABILITY as "<namespace>::<name>"."""
    message = f"{name}: not differentiable ({reason})"
    packet = getattr(getattr(torch.ops, namespace), name)
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        qualname = overload._schema.name
        if overload_name != "default":
            qualname = f"{qualname}.{overload_name}"
        if not torch._library.utils.is_functional_schema(overload._schema):
            _register_mutable_overload_kernel(qualname, overload, message)
        else:  # a C++ kernel (csrc/common/not_differentiable.cpp): no Python frame per call
            torch.ops.opennpu._mark_not_differentiable(qualname, message)
    key = name if namespace == "npu" else f"{namespace}::{name}"
    DIFFERENTIABILITY[key] = f"not differentiable: {reason}"


def _register_mutable_overload_kernel(qualname: str, overload, message: str) -> None:
    """An Autograd kernel for an op that writes into its arguments (register_autograd refuses
    those): runs the op below autograd, and raises when grad mode is on and an argument requires
    grad, since a gradient would be silently lost through the write."""

    @torch.library.impl(qualname, "Autograd")
    def _autograd_kernel(*args, **kwargs):
        if torch.is_grad_enabled():
            for name, t in _named_tensors(overload._schema, args, kwargs):
                if t.requires_grad:
                    raise RuntimeError(f"{message}; argument '{name}' requires grad")
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)
