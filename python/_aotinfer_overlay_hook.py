"""Start-up hook of aotinfer's flashinfer overlay (aotinfer/overlay.py).

``aotinfer_overlay.pth``, which the wheel installs beside this file, calls ``register()`` at Python
start only when AOTINFER_FLASHINFER is set. That adds a finder which waits for the first import of
flashinfer and only then imports aotinfer and installs the overlay: a process that never imports
flashinfer (a compile worker, a tool) does not pay for importing aotinfer. This file lives outside
the aotinfer package because importing anything inside it runs aotinfer's ``__init__``.
"""

import os
import sys

#: Values of AOTINFER_FLASHINFER that leave the overlay off (overlay.parse_families agrees).
OFF = ("", "0", "false", "no", "off")


class _FirstImportOfFlashInfer:
    aotinfer_overlay_hook = True  # how overlay.install finds and removes it

    def find_spec(self, name, path=None, target=None):
        if name != "flashinfer" and not name.startswith("flashinfer.") and name != "aotinfer._real_flashinfer":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        from aotinfer import overlay

        if not overlay.install_from_environment():
            return None
        return overlay.find_spec(name, path, target)


def register():
    """Adds the finder, once, unless AOTINFER_FLASHINFER is off."""
    if os.environ.get("AOTINFER_FLASHINFER", "").strip().lower() in OFF:
        return
    if not any(getattr(f, "aotinfer_overlay_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _FirstImportOfFlashInfer())
