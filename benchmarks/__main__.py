"""``python -m benchmarks NAME [flags]``: run benchmark NAME (``--help`` for its flags);
``python -m benchmarks``: list the benchmarks with their one-line descriptions."""

from __future__ import annotations

import importlib
import sys

from benchmarks import description, names


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = names()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, known))
        print("usage: python -m benchmarks NAME [flags]   (python -m benchmarks NAME --help for its flags)\n")
        for name in known:
            print(f"  {name:<{width}}  {description(name)}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in known:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(known)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    out = module.main(rest)
    # a benchmark may say that its result is a failure (e.g. losses that should be equal differ)
    exit_code = getattr(module, "exit_code", None)
    return exit_code(out) if exit_code is not None and isinstance(out, dict) else 0


if __name__ == "__main__":
    raise SystemExit(main())
