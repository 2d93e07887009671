"""`apex.amp`: mixed precision as Ascend's apex fork offers it, on the npu device.

``model, optimizer = amp.initialize(model, optimizer, opt_level="O1" | "O2", loss_scale=...)``,
``with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()``,
``amp.state_dict()`` / ``amp.load_state_dict()``. See ``_frontend`` for the opt levels and what is
approximated.
"""

from ._frontend import initialize, load_state_dict, master_params, scale_loss, state_dict

__all__ = ["initialize", "scale_loss", "state_dict", "load_state_dict", "master_params"]
