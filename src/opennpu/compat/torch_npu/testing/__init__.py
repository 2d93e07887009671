"""`torch_npu.testing`: opennpu's own implementation of Ascend's test harness API, so that
torch_npu's test files import and run unchanged.

- `testcase`: `TestCase` (assertRtolEqual, a tolerant assertEqual over npu/cpu tensors, numpy
  arrays and containers) and `run_tests`.
- `common_utils`: `create_common_tensor`, `create_dtype_tensor`, `SupportedDevices`,
  `SkipIfNotGteCANNVersion`, `freeze_rng_state` and the small helpers tests import.
- `decorator`: `Dtypes`, `Formats`, `instantiate_tests`.
"""
