"""torchair.core: `from torchair.core.utils import logger, EVENT_LEVEL`."""
from . import utils
