"""The core's former name: ``inspector.capture`` and its modules are ``inspector.core``'s, with a
DeprecationWarning. The old name goes in the release after next."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

warnings.warn("inspector.capture is now inspector.core; import it by that name", DeprecationWarning, stacklevel=2)

from inspector.core import *  # noqa: E402,F401,F403 - the package's own names
from inspector.core import __all__  # noqa: E402,F401


class _FormerName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``inspector.capture.X`` is the module ``inspector.core.X`` itself (one object, two names)."""

    OLD, NEW = "inspector.capture.", "inspector.core."

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith(self.OLD) else None

    def create_module(self, spec):
        return importlib.import_module(self.NEW + spec.name[len(self.OLD):])

    def exec_module(self, module):
        pass  # already run under its own name


if not any(isinstance(finder, _FormerName) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FormerName())
