"""torch.compile on npu tensors: Inductor's C++ code generator and Dynamo's device interface for
the `npu` device.

npu memory is host memory, laid out as on the CPU, so the kernels Inductor's C++ backend writes for
the CPU run unchanged on npu tensors' data pointers. What differs is the host side: buffers the
compiled graph allocates must be npu tensors on the graph's device index (so that they are
counted by the device allocator and the outputs stay on npu), and the wrapper must call the C++
kernels as it calls CPU ones. Extern kernels (mm, convolution, fallbacks) are ATen calls that
dispatch on npu as in eager mode.

Registration is lazy: Inductor calls `init_backend_registration()` before it compiles anything,
and that looks up `torch.npu.Scheduling` (PyTorch's hook for a PrivateUse1 backend); the
`torch.npu` module answers it by importing this module, which registers everything below. So
`import torch_npu` never imports torch._inductor. `register()` does the same explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device
from torch._inductor.codegen.common import (
    get_scheduling_for_device,
    register_backend_for_device,
)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.virtualized import V

_CPU = torch.device("cpu")


def _npu():
    return torch.npu  # the registered device module (opennpu.npu)


class NpuInterface(DeviceInterface):
    """Dynamo's and Inductor's view of the npu device: torch.npu's devices, streams and events.
    Work runs in program order on the host, so synchronize() returns at once."""

    class device:  # noqa: N801  (DeviceInterface's name)
        def __new__(cls, device: torch.types.Device):
            return _npu().device(device)

    class Event:  # noqa: N801
        def __new__(cls, *args: Any, **kwargs: Any):
            return _npu().Event(*args, **kwargs)

    class Stream:  # noqa: N801
        def __new__(cls, *args: Any, **kwargs: Any):
            return _npu().Stream(*args, **kwargs)

    class Worker:
        # Inductor's compile workers read device facts through these without initialising a
        # device; an emulated npu needs no initialisation.
        @staticmethod
        def set_device(device: int) -> None:
            _npu().set_device(device)

        @staticmethod
        def current_device() -> int:
            return _npu().current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            return _npu().get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return _npu().current_device()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        _npu().set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        previous = _npu().current_device()
        if device >= 0 and device != previous:
            _npu().set_device(device)
        return previous

    @staticmethod
    def exchange_device(device: int) -> int:
        return NpuInterface.maybe_exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return _npu().device_count()

    @staticmethod
    def is_available() -> bool:
        return _npu().is_available()

    @staticmethod
    def stream(stream: torch.Stream):
        return _npu().stream(stream)

    @staticmethod
    def current_stream() -> torch.Stream:
        return _npu().current_stream()

    @staticmethod
    def set_stream(stream: torch.Stream) -> None:
        _npu().set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        _npu().set_stream(torch.Stream(stream_id=stream_id, device_index=device_index,
                                       device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return 0  # host execution: no stream handle for a kernel to take

    @staticmethod
    def synchronize(device: torch.types.Device = None) -> None:
        _npu().synchronize(device)

    @classmethod
    def get_device_properties(cls, device: torch.types.Device = None) -> Any:
        return _npu().get_device_properties(device)

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> str:
        return ""  # no GPU compute capability: Inductor's C++ backend ignores it

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device: torch.types.Device = None) -> int:
        return _npu().memory_allocated(device)

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return False


class _NpuWrapperMixin:
    """What the Python wrapper does differently on npu: allocations are npu tensors on the
    buffer's device index. (Kernel calls are written while NpuScheduling has made the CPU the
    current device, so they take the CPU's form.)"""

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                        is_pinned=False):
        if device.type != "npu":
            return super().make_allocation(name, device, dtype, shape, stride,
                                           allocation_shape, is_pinned)
        if allocation_shape is None:
            allocation_shape = shape
        shape_code = self.codegen_python_shape_tuple(shape)
        allocation_code = self.codegen_python_shape_tuple(allocation_shape)
        stride_code = self.codegen_python_shape_tuple(stride)
        # The index is explicit: the graph may run while another npu device is current.
        index = device.index if device.index is not None else _npu().current_device()
        line = (f"{name} = empty_strided({allocation_code}, {stride_code}, "
                f"device='npu:{index}', dtype={dtype})")
        if shape_code != allocation_code:
            line += f".as_strided({shape_code}, {stride_code})"
        return line


class NpuPythonWrapperCodegen(_NpuWrapperMixin, PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph: bool, subgraph_name: Optional[str],
               parent_wrapper: Optional[PythonWrapperCodegen], partition_signatures=None):
        if is_subgraph:
            if subgraph_name is None or parent_wrapper is None:
                raise ValueError("NpuPythonWrapperCodegen.create: a subgraph needs its name and "
                                 f"parent wrapper, got {subgraph_name!r} and {parent_wrapper!r}")
            return NpuSubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                   partition_signatures)
        return NpuPythonWrapperCodegen()


class NpuSubgraphPythonWrapperCodegen(_NpuWrapperMixin, SubgraphPythonWrapperCodegen):
    pass


class NpuScheduling(CppScheduling):
    """Inductor's C++ kernels (CppScheduling) for npu buffers.

    While it writes a kernel, the graph's current device is the CPU: that is the code the kernel
    is (C++ loops over host memory), and Inductor picks the kernel language and the call
    convention from the current device's type (utils.get_current_backend would otherwise answer
    config.cuda_backend, "triton", for any device it does not know). The buffers keep their npu
    layouts, so the wrapper still allocates them on npu."""

    def codegen_node(self, node):
        with V.graph.set_current_device(_CPU):
            super().codegen_node(node)

    def codegen_template(self, template_node, epilogue_nodes, prologue_nodes):
        with V.graph.set_current_device(_CPU):
            return super().codegen_template(template_node, epilogue_nodes, prologue_nodes)

    def flush(self):
        with V.graph.set_current_device(_CPU):
            super().flush()


class NpuCppWrapperCodegen(CppWrapperCpu):
    """Inductor's C++ wrapper (config.cpp_wrapper, AOTInductor) is not provided on npu: it would
    allocate through AOTInductor's C shim, which has no npu allocator here. The class answers
    Inductor's questions about the CPU's C++ wrapper and refuses to be created."""

    @staticmethod
    def create(*args: Any, **kwargs: Any):
        raise NotImplementedError(
            "opennpu: Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper=True, "
            "AOTInductor) is not supported on npu tensors; compile with cpp_wrapper=False "
            "(the default)")


def _is_npu(x) -> bool:
    from torch._inductor.ir import get_device_type

    return get_device_type(x) == "npu"


def _cpu_heuristics_for_npu() -> None:
    """Inductor decides a few things by `device.type == "cpu"` where it means "the C++ backend
    writes these kernels"; npu's kernels are those, so npu must get the CPU answer. Inductor has no
    registration hook for these, so three functions are wrapped, each answering as before for
    every other device:

    - lowering.div_prim: off the CPU, dividing by a constant becomes a multiplication by its
      reciprocal, which rounds differently (pytorch#157959); on npu the division stays, so
      compiled npu code computes CPU's bits (eager's too). It is called by name from
      aten.div's lowering and registered as prims.div's, so both are replaced.
    - ir.is_cpu: realizing a reused buffer computed with heavy ops (exp, sigmoid) instead of
      recomputing it in every consumer, a C++-backend heuristic.
    - BaseSchedulerNode.is_cpu: no loop reordering for fusion, which the C++ backend does not
      support."""
    from torch._inductor import ir, lowering, scheduler
    from torch._inductor.virtualized import ops

    if getattr(lowering.div_prim, "_opennpu", False):
        return
    inductor_div_prim = lowering.div_prim

    def div_prim(a, b):
        integral = all(lowering.is_boolean_type(x) or lowering.is_integer_type(x)
                       for x in (a, b))
        if (not integral and isinstance(a, ir.IRNode) and _is_npu(a)
                and lowering.get_constant_value(b) is not None):
            return lowering.make_pointwise(ops.truediv)(a, b)
        return inductor_div_prim(a, b)

    div_prim._opennpu = True
    lowering.div_prim = div_prim
    lowering.register_lowering(torch.ops.prims.div, broadcast=True)(div_prim)

    inductor_is_cpu = ir.is_cpu
    ir.is_cpu = lambda x: inductor_is_cpu(x) or _is_npu(x)

    node_is_cpu = scheduler.BaseSchedulerNode.is_cpu

    def is_cpu(self) -> bool:
        device = self.get_device()
        return node_is_cpu(self) or (device is not None and device.type == "npu")

    scheduler.BaseSchedulerNode.is_cpu = is_cpu


_registered = False


def register() -> None:
    """Registers the npu device with Dynamo and Inductor (idempotent)."""
    global _registered
    if _registered:
        return
    register_interface_for_device("npu", NpuInterface)
    for index in range(_npu().device_count()):
        register_interface_for_device(f"npu:{index}", NpuInterface)
    if get_scheduling_for_device("npu") is None:
        register_backend_for_device("npu", NpuScheduling, NpuPythonWrapperCodegen,
                                    NpuCppWrapperCodegen)
    _cpu_heuristics_for_npu()
    _registered = True


register()
