"""torchair.inference (see opennpu.compile.torchair_api.inference)."""
from opennpu.compile.torchair_api.inference import cache_compile, readable_cache, set_dim_gears

__all__ = ["cache_compile", "readable_cache", "set_dim_gears"]
