"""The protocol every process role shares: the shared-memory layout (read from the C
core, which holds the one declaration in csrc/shmserve.h), the ring view, data types
and the control-socket codec. docs/protocol.md is the prose."""
from .control import *  # noqa: F401,F403
from .dtypes import *  # noqa: F401,F403
from .layout import *  # noqa: F401,F403
from .ring import *  # noqa: F401,F403
from .options import *  # noqa: F401,F403
from .dtypes import _NUMPY  # noqa: F401
