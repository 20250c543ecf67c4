"""`python -m syncer.native`: build (or find) the native merge kernel now, as a declared step.

Prints one JSON line, {"ok": true, "path": ...} or {"ok": false, "problem": ...}, and exits 0 or 1.
`dldctl up` runs it before it starts the syncer and `dldctl check` reports it, so a host without
a C compiler is named before the run, not found out from a slower merge.
"""

from __future__ import annotations

import json
import sys

from syncer import native


def main() -> int:
    kernel = native.load()
    if kernel is None:
        print(json.dumps({"ok": False, "problem": native.problem}))
        return 1
    print(json.dumps({"ok": True, "path": str(kernel.path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
