"""``from torch_npu.contrib import transfer_to_npu``: importing this module applies
opennpu.migrate.transfer's patches (once), so CUDA code runs on the npu device unchanged.

The underscored names are torch_npu's names for the rewriting helpers, which its tests call.
"""

from opennpu.migrate import transfer as _transfer
from opennpu.migrate.transfer import (  # noqa: F401
    _check_input_file_valid, _del_nccl_device_backend_map, _replace_cuda_to_npu_in_dict,
    _wrapper_cuda, _wrapper_hccl, _wrapper_libraries_func)

__all__: list[str] = []

_transfer.apply()


def _load_json_file(path):
    """The JSON object in `path`, or {} when `_check_input_file_valid(path)` fails or the file
    holds no object."""
    return _transfer._load_json_file(path, check=_check_input_file_valid)
