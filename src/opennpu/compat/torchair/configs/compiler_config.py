"""torchair.configs.compiler_config.CompilerConfig is opennpu.compile's CompilerConfig."""
from opennpu.compile.config import CompilerConfig

__all__ = ["CompilerConfig"]
