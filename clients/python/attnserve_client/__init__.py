"""The client's former name: `attnserve` under another name, for scripts that import it."""
from attnserve import *  # noqa: F401,F403
from attnserve import __all__, __version__  # noqa: F401
