"""python3 .ci/python_deps.py REQUIREMENT...: each REQUIREMENT (`name==version`, or `name` for
any version) is installed, imports, and imports at its version. Exits 0, or 1 with one line on
stderr naming the first that does not (and why): a package that installs but fails to import (a
torch it was not built for is enough) or that another copy shadows must stop CI, not turn its
tests into skips."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import warnings

# The module a distribution is imported as, where it is not the name with - made _.
MODULES = {"megatron-core": "megatron.core"}


def problem(requirement: str) -> str | None:
    name, _, pinned = requirement.partition("==")
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "is not installed"
    if pinned and installed != pinned:
        return f"is {installed} (installed), not {pinned}"
    module = MODULES.get(name, name.replace("-", "_"))
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # any failure to import is the finding
        return f"does not import ({module}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    # The copy imported is the one installed (torch's "2.15.0+cu130": the public part).
    version = str(getattr(imported, "__version__", installed)).split("+")[0]
    if pinned and version != pinned:
        return f"imports as {version} from {getattr(imported, '__file__', module)}, not {pinned}"
    return None


def main() -> int:
    warnings.simplefilter("ignore")  # what a package says while it imports is not the check's
    for requirement in sys.argv[1:]:
        found = problem(requirement)
        if found:
            print(f"error: {requirement.partition('==')[0]} {found} (python {sys.version.split()[0]}: "
                  f"{sys.executable})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
