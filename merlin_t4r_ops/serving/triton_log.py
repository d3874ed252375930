"""Read from tritonserver's log why it failed, so that an error can lead with the cause.

A failed start ends a log of 70-odd lines, most of them tables; the line that matters is
Triton's ``failed to load '<model>' version <n>: <error>``, which carries the Python
exception raised in the model's ``initialize`` (the file, the digest, the traceback).
"""

import json
import re
from typing import Iterator, List, Tuple

__all__ = ["failure_causes"]

# E1203 13:13:50.111704 7646 model_lifecycle.cc:642] "failed to load 'm' version 1: ..."
_LINE = re.compile(r'^(?P<severity>[IWE])\d{4} \S+\s+\d+ [^\]]+\] "(?P<message>.*)"\s*$')
_LOAD_FAILURE = re.compile(
    r"^failed to load '(?P<model>[^']+)' version (?P<version>\d+): (?P<error>.*)$", re.S)


def _unescape(text: str) -> str:
    """Triton writes each message as one quoted line, newlines escaped."""
    try:
        return json.loads(f'"{text}"')
    except ValueError:
        return text


def _messages(log: str) -> Iterator[Tuple[str, str]]:
    for line in log.splitlines():
        match = _LINE.match(line)
        if match:
            yield match["severity"], _unescape(match["message"]).strip()


def failure_causes(log: str) -> List[str]:
    """Why the server failed: one entry per model that failed to load, else its last error.

    Returns an empty list when the log names no error.
    """
    errors = [message for severity, message in _messages(log) if severity == "E"]
    failed_models = [
        f"model '{m['model']}' (version {m['version']}) failed to load: {m['error']}"
        for m in map(_LOAD_FAILURE.match, errors) if m
    ]
    if failed_models:
        return failed_models
    fatal = [line for line in log.splitlines() if line.startswith("error: ")]
    return fatal or errors[-1:]
