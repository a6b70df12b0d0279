"""`python -m zaya.evals ARGS`: the `lm_eval` command with the `zaya` model registered, e.g.

    python -m zaya.evals --model zaya --model_args path=runs/tiny --tasks hellaswag --limit 100

lm_eval 0.4.13 finds models only in its own registry (no entry points), so the plain `lm_eval` command
cannot know `--model zaya`; this is that command after `zaya.evals.harness` has registered it.
"""

from __future__ import annotations

import sys

from zaya.errors import ZayaError


def main() -> int:
    """Run lm_eval's command line with `--model zaya` available; a `ZayaError` is one line, exit code 2."""
    try:
        from zaya.evals.run import import_lm_eval

        import_lm_eval()
        from lm_eval.__main__ import cli_evaluate

        import zaya.evals.harness  # noqa: F401  (registers the model)

        sys.argv[0] = "python -m zaya.evals"
        cli_evaluate()
    except ZayaError as exc:
        print(f"zaya: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
