#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and torch installed: the native CUDA
# kernels' tests, the portable path's CUDA tests, then the CUDA kernel benchmark.
#   bash scripts/gpu_check.sh [OUTDIR]
# opennpu must be importable (installed, or PYTHONPATH naming a folder that holds a built copy);
# Liger-Kernel is benchmarked when importable. Logs and the benchmark's JSON go to OUTDIR.
# GPU_CHECK_BENCH_S: the benchmark's time limit in seconds (default 300; 0 skips it).
set -uo pipefail
out="${1:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, opennpu; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
status=0
python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_cuda_kernels.py tests/ops/test_infer_attention_cuda.py \
  tests/ops/test_attention_flash.py tests/ops/test_llm_decode_e2e.py \
  tests/device/test_registration.py::test_beside_a_gpu_torch_npu_needs_the_switch_which_warns_about_cuda_autograd \
  tests/optim/test_optim_portable.py::test_optimizers_on_cuda_match_cpu \
  tests/compile/test_rules_devices.py::test_cuda_fuses_only_ops_with_cuda_kernels \
  2>&1 | tee "$out/cuda_kernels.log" | tail -40 || status=1
python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests/ops/test_portable.py 2>&1 | tee "$out/portable_cuda.log" | tail -40 || status=1
bench_s="${GPU_CHECK_BENCH_S:-300}"
if [ "$bench_s" -gt 0 ]; then
  timeout "$bench_s" python3 -m benchmarks.cuda_kernels --json "$out/cuda_kernels.json" 2>&1 | tee "$out/bench.log" || status=1
fi
exit $status
