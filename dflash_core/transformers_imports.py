"""transformers without the optional imports the daemon never uses.

transformers' generation utilities, which every model class imports, import scikit-learn at
module level wherever it is installed: its `roc_curve` serves only assisted generation's
adaptive confidence threshold (an assistant model proposing tokens to `generate`). Nothing here
calls `generate` with an assistant, and on hosts whose image carries scikit-learn every daemon
start and every compile child would import it (and scipy and joblib behind it) for nothing.
`skip_unused_imports` makes transformers see scikit-learn as absent, in this process only and
before the generation utilities are first imported; elsewhere transformers is as installed.
"""

from __future__ import annotations

import sys

# the generation module that imports scikit-learn when transformers finds it
_IMPORTER = "transformers.generation.candidate_generator"


def _unavailable() -> bool:
    return False


def skip_unused_imports() -> bool:
    """Have transformers' generation utilities skip scikit-learn. True where this took effect:
    the generation utilities not imported yet, and a transformers whose check has the name this
    overrides (elsewhere it changes nothing, and the import costs what it did)."""
    if _IMPORTER in sys.modules:
        return False
    import transformers.utils as hf_utils

    if not hasattr(hf_utils, "is_sklearn_available"):
        return False
    # the generation module binds the check from transformers.utils when it is imported
    hf_utils.is_sklearn_available = _unavailable
    return True
