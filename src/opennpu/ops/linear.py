"""opennpu::_linear: F.linear for the compile backend's float32 linears on CPU and npu.

Not a torch_npu API: the `linear_onednn` graph rule (compile/rules/linear.py) puts it in place of
a linear's aten.mm / aten.addmm, and its C++ kernel (csrc/ops/linear) sends the product to oneDNN
where that beats MKL's sgemm (float32, 64 rows and 512 outputs or more) and to aten::linear otherwise. Its
gradients are those of F.linear, so a training graph's forward may hold it too.
"""

from __future__ import annotations

import torch

from ._registry import register_fake

__all__: list[str] = []


@register_fake("opennpu::_linear")
def _linear_fake(input, weight, bias=None):
    torch._check(weight.dim() == 2 and input.dim() >= 1 and input.shape[-1] == weight.shape[1],
                 lambda: f"_linear: input {tuple(input.shape)} and weight {tuple(weight.shape)} "
                         "do not chain (input [..., K], weight [N, K])")
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _save_operands(ctx, inputs, output):
    input, weight, bias = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None


def _linear_bwd(ctx, grad):
    input, weight = ctx.saved_tensors
    grad_input = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = (grad.reshape(-1, grad.shape[-1]).mT @ input.reshape(-1, input.shape[-1])
                   if ctx.needs_input_grad[1] else None)
    grad_bias = (grad.reshape(-1, grad.shape[-1]).sum(0)
                 if ctx.has_bias and ctx.needs_input_grad[2] else None)
    return grad_input, grad_weight, grad_bias


torch.library.register_autograd("opennpu::_linear", _linear_bwd, setup_context=_save_operands)
