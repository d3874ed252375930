"""The docs run: every Python block of README.md and docs/*.md is a test (sybil).

Blocks of one page share one namespace, in page order, so a block may use the names of the
blocks above it. Each page runs in a fresh temporary working directory, so the files its
blocks write (``data/``, ``categories/``, ``model_repository/``) start from nothing and go away
after it. A block that cannot run says why, in the page, with a ``skip`` directive.
"""

import os
import shutil
import tempfile
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent


def _enter_a_fresh_directory(namespace):
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_dir"] = tempfile.mkdtemp(prefix="merlin-t4r-docs-")
    os.chdir(namespace["_docs_dir"])


def _leave_it(namespace):
    os.chdir(namespace["_docs_cwd"])
    shutil.rmtree(namespace["_docs_dir"], ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    path=str(ROOT),
    setup=_enter_a_fresh_directory,
    teardown=_leave_it,
).pytest()
