"""GPU-to-NPU migration tools.

* `opennpu.migrate.transfer`: the run-time migration behind
  ``from torch_npu.contrib import transfer_to_npu`` (patches that make CUDA code run on the npu
  device unchanged, with an optional CSV log of every rewrite).
* `opennpu.migrate.convert`: the offline source converter (msFmkTransplt's rules and reports),
  run with ``python -m opennpu.migrate`` or ``opennpu migrate``.
"""
