"""`apex`, Ascend's fork of NVIDIA apex as seed 001 uses it, provided by opennpu when no apex is
installed: ``from apex import amp`` (``amp.initialize``, ``amp.scale_loss``, ``amp.state_dict``)
and ``apex.optimizers.NpuFused*`` (opennpu's fused optimizers).

The import hook in ``_opennpu_compat`` maps ``apex`` here and steps aside when a package named apex
is installed (NVIDIA's or Ascend's apex then loads as usual). See ``apex.amp`` for what O1 and O2
do here and what is approximated.
"""

from __future__ import annotations

from . import amp, optimizers  # noqa: F401

IS_OPENNPU = True

__all__ = ["amp", "optimizers"]
