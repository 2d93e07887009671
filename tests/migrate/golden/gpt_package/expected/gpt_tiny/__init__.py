from .model import TinyGPT

__all__ = ["TinyGPT"]
