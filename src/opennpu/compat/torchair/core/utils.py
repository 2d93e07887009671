"""torchair.core.utils: the logger and TorchAir's EVENT log level."""
from opennpu.compile.torchair_api.logger import EVENT_LEVEL, logger

__all__ = ["EVENT_LEVEL", "logger"]
