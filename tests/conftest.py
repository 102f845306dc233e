"""Suite-wide settings. Under CI (CI=true) hypothesis runs derandomized, so a CI verdict depends only
on the code; locally it keeps exploring new examples on every run."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
