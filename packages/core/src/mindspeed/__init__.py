"""mindspeed: the acceleration core of the mindspeed training suite.

Importing this package changes nothing outside it: no torch attribute is patched, no
environment variable is written and ``sys.argv`` is never read. Everything that alters
behaviour (selecting an accelerator, adapting megatron-core, applying features) is an
explicit call.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mindspeed-core")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
