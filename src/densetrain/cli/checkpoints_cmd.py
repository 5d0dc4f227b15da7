"""`densetrain checkpoints PATH`: which checkpoints of a run can be trusted.

PATH is a run directory, its ``checkpoints/`` directory or one ``step-N`` checkpoint, local or
an fsspec URL (``s3://bucket/run/checkpoints``, read-only as on disk). Every
``step-N`` is verified against its manifest (the size and SHA-256 of every file, as a resume,
``eval`` and ``export`` check it) and listed newest first with its size and, when damaged, each
file that does not match; checkpoints set aside as damaged by an earlier resume and saves left
incomplete (``.tmp``) are listed too. Nothing is changed on disk.

Exit status: 0 when every ``step-N`` verifies, 1 when one or more is damaged (the first that
verifies is the one a resume, ``eval`` or ``export`` would use), 2 when PATH holds no
checkpoint.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``checkpoints`` sub-command."""
    parser = subparsers.add_parser(
        "checkpoints", help="verify a run's checkpoints and list which can be trusted",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", metavar="PATH",
                        help="run directory, checkpoint directory or step-N checkpoint")
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.set_defaults(func=run_checkpoints)


def run_checkpoints(args: argparse.Namespace) -> int:
    """Verify and list; the exit status as the module docstring says."""
    import dataclasses
    from pathlib import Path

    from densetrain.checkpoint.objstore import check_reachable, is_remote
    from densetrain.checkpoint.reading import survey_checkpoints
    from densetrain.errors import UserError

    if is_remote(args.path):
        check_reachable(args.path)  # a missing bucket or refused access: one line naming PATH
    elif not Path(args.path).is_dir():
        raise UserError(f"{args.path} is not a directory; give a run directory, its "
                        "checkpoints/ directory or a step-N checkpoint")
    root, found = survey_checkpoints(args.path)
    steps = [c for c in found if c.step is not None]
    if not found:
        raise UserError(f"{args.path} holds no checkpoint (no step-N directory in it or in its "
                        "checkpoints/)")
    usable = next((c.name for c in steps if c.state == "verified"), None)
    if args.json:
        print(json.dumps({"directory": str(root), "used": usable,
                          "checkpoints": [dataclasses.asdict(c) for c in found]}, indent=2))
    else:
        print(f"{root}:")
        for c in found:
            print(f"  {c.name:<24} {c.state:<10} {c.bytes / 1e6:10.1f} MB")
            for problem in c.damage:
                print(f"      {problem}")
        if usable:
            print(f"a resume, eval or export uses {usable}")
        elif steps or any(c.state == "set aside" for c in found):
            print("no checkpoint verifies: a resume refuses, eval and export have nothing to "
                  "read")
        else:
            print("no save completed: a resume starts from step 0, eval and export have "
                  "nothing to read")
    return 1 if any(c.state == "damaged" for c in steps) else 0
