"""Where a page the help cites is on this machine: the checkout's docs/, or the installed copy.

The wheel installs docs/*.md and inventory.example.toml as data files under
`<prefix>/share/doc/dldctl/` (pyproject.toml, `[tool.setuptools.data-files]`): a venv's root, or
the user base for `pip install --user`. From a checkout (an editable install) the help keeps the
short `docs/NAME` that the source tree shows; installed, it names the absolute path to open.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
INSTALLED = Path("share") / "doc" / "dldctl"  # under the install scheme's data directory


def installed_dirs() -> list[Path]:
    """The directories the wheel's data files may have gone to: the default scheme, then the user's."""
    out = [Path(sysconfig.get_path("data")) / INSTALLED]
    user = f"{os.name}_user"
    if user in sysconfig.get_scheme_names():
        out.append(Path(sysconfig.get_path("data", user)) / INSTALLED)
    return out


def doc(name: str) -> str:
    """How to name docs/`name` to the reader: `docs/NAME` in a checkout, else the installed file."""
    if (CHECKOUT / "docs" / name).is_file():
        return f"docs/{name}"
    for where in installed_dirs():
        if (where / name).is_file():
            return str(where / name)
    return f"docs/{name}"  # neither: the name the project's source uses
