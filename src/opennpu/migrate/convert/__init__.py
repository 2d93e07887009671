"""Offline CUDA-to-NPU converter compatible with Ascend's msFmkTransplt (``ms_fmk_transplt.py``).

A LibCST rewriter: the mapping rules are data (``rules/*.json``, loaded by :mod:`.rules`), the
rewriting is :class:`.transformer.FileConverter`, the result files with msFmkTransplt's names and
columns are written by :mod:`.reports`, and :mod:`.cli` is the command line.
See docs/migrate_converter.md.
"""

from .transformer import ConvertOptions, FileResult, convert_source

__all__ = ["ConvertOptions", "FileResult", "convert_source"]
