"""`torch_npu.testing`: opennpu's own implementation of Ascend's test harness API, so that
torch_npu's test files import and run unchanged.

- `testcase`: `TestCase` (assertRtolEqual, a tolerant assertEqual over npu/cpu tensors, numpy
  arrays and containers) and `run_tests`.
- `common_utils`: `create_common_tensor`, `create_dtype_tensor`, `SupportedDevices`,
  `SkipIfNotGteCANNVersion`, `freeze_rng_state` and the small helpers tests import.
- `decorator`: `Dtypes`, `Formats`, `instantiate_tests`.
"""

import os as _os


def _device_type_tests_on_npu() -> None:
    """PyTorch tests that `import torch_npu.testing` and call instantiate_device_type_tests run
    on npu, as with torch_npu: the custom device (PrivateUse1, "npu") is instantiated instead of
    cpu and cuda, and CUDA-only decorators and flags mean npu. The environment variables are set
    only where the user has not set them."""
    _os.environ.setdefault("PYTORCH_TESTING_DEVICE_FOR_CUSTOM", "privateuse1")
    _os.environ.setdefault("PYTORCH_TESTING_DEVICE_EXCEPT_FOR", "cuda,cpu")
    from torch.testing._internal import common_device_type, common_utils

    common_device_type.onlyCUDA = common_device_type.onlyPRIVATEUSE1
    common_utils.TEST_CUDA = common_utils.TEST_PRIVATEUSE1


_device_type_tests_on_npu()
