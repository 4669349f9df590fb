"""Suite-wide settings.

Task environments: tests that build a Dockerfile exercise the host-root mode unless they
ask for images (tests/tasks/test_images.py does, explicitly), so the default suite does
not build a podman image per test task; `RIDGELINE_TASK_ENV` set by the caller wins.
"""

import os

os.environ.setdefault("RIDGELINE_TASK_ENV", "host")
