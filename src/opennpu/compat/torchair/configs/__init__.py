"""torchair.configs: `from torchair.configs.compiler_config import CompilerConfig`."""
from . import compiler_config
