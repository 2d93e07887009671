from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(
    name="fused_bias",
    ext_modules=[CUDAExtension("fused_bias", ["csrc/fused_bias.cpp", "csrc/fused_bias_kernel.cu"])],
    cmdclass={"build_ext": BuildExtension},
)
