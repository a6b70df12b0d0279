"""`--include` and `--exclude`: which files inside an input directory a build reads.

Patterns are globs matched against a file's path relative to the input directory (with `/` between parts)
and against its name alone, so `*.py` selects Python files at any depth and `src/*.py` only those directly in
`src/`. `*` and `?` stop at `/`; `**` crosses it (`docs/**/*.md`, `**/test_*.py`); `[abc]` and `[!abc]` are
character classes. Matching is case-sensitive, like the file system.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    """Which files of an input directory to read: those matching an `include` pattern (any file of a known
    kind when there are none) and no `exclude` pattern."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def included(self, relative: str) -> bool:
        """Whether a path relative to the input directory matches an include pattern."""
        return _matches_any(self.include, relative)

    def excluded(self, relative: str) -> bool:
        """Whether a path relative to the input directory matches an exclude pattern."""
        return _matches_any(self.exclude, relative)


def _matches_any(patterns: tuple[str, ...], relative: str) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return any(_compiled(p).fullmatch(relative) or _compiled(p).fullmatch(name) for p in patterns)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    """The regular expression of a glob (see the module docstring)."""
    glob = pattern.strip("/")
    out, i = [], 0
    while i < len(glob):
        char = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")  # any number of directories, none included
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]*")
            i += 1
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[" and (end := glob.find("]", i + 2)) > 0:
            body = glob[i + 1:end]
            negated = body.startswith("!")
            body = re.escape(body[1:] if negated else body).replace("\\-", "-")
            out.append(f"[{'^/' if negated else ''}{body}]")
            i = end + 1
        else:
            out.append(re.escape(char))
            i += 1
    return re.compile("".join(out))
