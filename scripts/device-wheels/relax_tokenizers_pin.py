"""Relax transformers 4.30's import-time pin ``tokenizers<0.14`` in an installed copy.

transformers 4.30.2 checks, on ``import transformers``, that the installed tokenizers is
``>=0.11.1,!=0.11.3,<0.14`` (``dependency_versions_check.py`` reads the pin from
``dependency_versions_table.py``). The GPU machine has tokenizers 0.23, and tokenizers 0.13
has no CPython 3.12 wheel. This project never tokenizes text (its models take item ids), so
the upper bound is dropped from the table of the *installed* copy; the wheel stays as the
registry ships it. The change is printed as a unified diff so the setup log shows it.

Usage: python relax_tokenizers_pin.py SITE_PACKAGES_DIR
"""

import difflib
import pathlib
import sys

PINNED = '"tokenizers": "tokenizers>=0.11.1,!=0.11.3,<0.14",'
RELAXED = '"tokenizers": "tokenizers>=0.11.1,!=0.11.3",'


def relax(site_packages):
    """Rewrite the pin in ``transformers/dependency_versions_table.py``; return a message."""
    table = pathlib.Path(site_packages, "transformers", "dependency_versions_table.py")
    if not table.is_file():
        raise SystemExit(f"relax_tokenizers_pin: no transformers install found: {table} is missing")
    before = table.read_text()
    if RELAXED in before:
        return f"relax_tokenizers_pin: {table} already relaxed"
    if before.count(PINNED) != 1:
        raise SystemExit(
            f"relax_tokenizers_pin: expected the line {PINNED!r} once in {table}; "
            "is this transformers 4.30.x?"
        )
    after = before.replace(PINNED, RELAXED)
    table.write_text(after)
    diff = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"{table} (as installed)", tofile=f"{table} (relaxed)", n=0,
    )
    return "relax_tokenizers_pin: patched the installed copy:\n" + "".join(diff)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(relax(sys.argv[1]))
