"""`torch_npu.utils`: the parts of it that scripts and checkpoints reach."""
