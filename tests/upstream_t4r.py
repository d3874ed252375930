"""Transformers4Rec's own test suite, fetched from its sdist on the package registry and run.

Nothing of T4R's tests lives in this repository: :func:`fetch_sdist` downloads the
release's sdist with pip (the registry is the only network CI has), and
:func:`extract_tests` unpacks its ``tests/`` package alone, so that the
``transformers4rec`` the tests import is the installed wheel (with its packaged
test data, ``transformers4rec.data.testing``), not the sdist's sources.
:func:`run_tests` runs T4R's test files in a pytest subprocess with the
``t4r_trainer_swap`` plugin, with T4R's Trainer or ours.
"""

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

T4R_VERSION = "23.12.0"
# The registry's sdist of transformers4rec 23.12.0; its tests/unit/torch/test_trainer.py is
# byte-identical to the tag v23.12.00's.
T4R_SDIST_SHA256 = "b7a892aa29ec110d158dff60af4928a40b910c247f2447d50268050c3576bf5e"
TESTS_DIR = Path(__file__).resolve().parent
OURS = "merlin_t4r_ops.training.trainer.Trainer"
T4RS = "transformers4rec.torch.trainer.Trainer"


def fetch_sdist(cache: Path) -> Path:
    """T4R's sdist, downloaded into ``cache`` once; a failed download raises, it never skips."""
    sdist = cache / f"transformers4rec-{T4R_VERSION}.tar.gz"
    if not sdist.exists():
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"transformers4rec=={T4R_VERSION}", "-d", str(cache),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not sdist.exists():
            raise RuntimeError(
                f"pip could not download transformers4rec=={T4R_VERSION}'s sdist "
                f"(exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != T4R_SDIST_SHA256:
        raise RuntimeError(f"{sdist} has sha256 {digest}, expected {T4R_SDIST_SHA256}")
    return sdist


def extract_tests(sdist: Path, destination: Path) -> Path:
    """Unpack the sdist's ``tests/`` package (conftests and assets included) under ``destination``.

    Returns the directory holding ``tests/``: T4R's conftest imports ``tests.unit...``,
    so pytest runs with it as its root.
    """
    prefix = f"transformers4rec-{T4R_VERSION}/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix + "tests/")]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(destination, members=members, filter="data")
    return destination


def run_tests(root: Path, test_files: List[str], trainer: str, workdir: Path) -> dict:
    """Run T4R's ``test_files`` (relative to ``root``) with ``trainer`` ("t4r" or "ours").

    Runs in ``workdir`` (T4R's tests write ``output_dir="."``). Returns
    ``{"outcomes": {test: outcome}, "record": plugin record, "command": str}``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    junit, record = workdir / "junit.xml", workdir / "trainers.json"
    command = [
        sys.executable, "-m", "pytest", *[str(root / f) for f in test_files],
        f"--rootdir={root}", "-p", "t4r_trainer_swap", f"--trainer={trainer}",
        f"--trainer-record={record}", f"--junitxml={junit}", "-p", "no:cacheprovider",
        "-q", "-rfE", "--durations=5", "-o", "timeout=900",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    log = workdir / "pytest.log"  # written as it runs: `tail -f` shows the progress
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    output = log.read_text()
    if not junit.exists() or not record.exists():
        raise RuntimeError(
            f"pytest of T4R's tests wrote no report (exit {done.returncode}):\n{output[-8000:]}"
        )
    return {
        "outcomes": junit_outcomes(junit),
        "record": json.loads(record.read_text()),
        "command": " ".join(command),
        "output": output,
    }


def junit_outcomes(path: Path) -> Dict[str, str]:
    """``{"file::test[param]": "passed" | "failed" | "error" | "skipped"}`` from a JUnit XML."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = "passed"
        for tag, kind in (("skipped", "skipped"), ("failure", "failed"), ("error", "error")):
            if tag in kinds:
                outcome = kind
        outcomes[name] = outcome
    return outcomes


def counts(outcomes: Dict[str, str]) -> Dict[str, int]:
    """How many tests had each outcome."""
    tally = {}
    for outcome in outcomes.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return tally
