"""docs/reproductions.md, generated from ``scaling.references`` (the tests' reference values)
and the presets' published sizes::

    python -m densetrain.scaling.reproductions --write docs/reproductions.md
    python -m densetrain.scaling.reproductions --check docs/reproductions.md   # exit 1 if stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from densetrain.scaling.references import (
    HF_PUBLISHED_REL_TOL,
    PHI1_PUBLISHED_PARAMS,
    PUBLISHED_PARAMS_TOLERANCE,
    REFERENCES,
    UNREPRODUCIBLE,
)

PRESET_TEST = "tests/unit/models/test_presets.py"
HEADER = """# Reproductions: what the papers disclosed, what densetrain computes

Every number below is a reference value of densetrain's tests, read from one place
(`densetrain.scaling.references` and the presets' `extra["published_params"]`); this page is
generated from it by `python -m densetrain.scaling.reproductions --write docs/reproductions.md`
and a test fails when the committed page differs from the generator's output. "densetrain" is
the value densetrain's own formulas give; "accepted" is the largest difference the named test
allows (usually the rounding of the printed figure).
"""


def _num(value: float, unit: str = "") -> str:
    text = f"{value:.4g}" if abs(value) < 1e4 else f"{value:.4e}"
    return f"{text} {unit}".strip()


def _diff(ours: float, published: float) -> str:
    if published == 0:
        return _num(ours - published)
    return f"{(ours - published) / published:+.2%}"


def reference_table() -> list[str]:
    """Rows of the published-number table."""
    lines = ["| quantity | paper, where | published | densetrain | difference | accepted | "
             "test |", "|---|---|---|---|---|---|---|"]
    for ref in REFERENCES:
        ours = float(ref.reproduce())
        exact = ref.tolerance <= 1e-9 * abs(ref.published)
        accepted = "exact (rel. 1e-12)" if exact else f"± {_num(ref.tolerance, ref.unit)}"
        lines.append(
            f"| {ref.quantity} | {ref.paper}, {ref.where} | {_num(ref.published, ref.unit)} | "
            f"{_num(ours, ref.unit)} | {_diff(ours, ref.published)} | "
            f"{accepted} | `{ref.test.split('::')[1]}` |")
    return lines


def preset_rows() -> list[tuple[str, str, float, float, str]]:
    """(preset, family, published, densetrain, accepted) for every preset with a published
    size."""
    from densetrain.models.presets import get_preset, list_presets
    from densetrain.models.sizing import param_counts

    rows = []
    for name in list_presets():
        cfg = get_preset(name)
        published = cfg.extra.get("published_params")
        if not published:
            continue
        family = cfg.extra["family"]
        count = param_counts(cfg).total
        if cfg.extra.get("hf_family"):
            if name == "phi-1":
                published = PHI1_PUBLISHED_PARAMS
            accepted = f"equal to transformers; ± {HF_PUBLISHED_REL_TOL:.0%} of published"
        else:
            rel, absolute = PUBLISHED_PARAMS_TOLERANCE[family]
            accepted = f"± {rel:.0%}" if rel else f"± {absolute / 1e9:g}B"
        rows.append((name, family, float(published), float(count), accepted))
    return rows


def preset_table() -> list[str]:
    """Rows of the preset-size table."""
    lines = ["| preset | family | published | densetrain | difference | accepted |",
             "|---|---|---|---|---|---|"]
    for name, family, published, count, accepted in preset_rows():
        lines.append(f"| {name} | {family} | {published / 1e9:.4g}B | {count:,.0f} | "
                     f"{_diff(count, published)} | {accepted} |")
    return lines


def render() -> str:
    """The whole page."""
    lines = [HEADER, "## Published numbers", "", *reference_table(), "",
             "Tests: `tests/unit/models/test_sizing.py`, `tests/unit/planner/"
             "test_planner_memory.py`, `tests/unit/planner/test_planner_compute_comm.py`, "
             "`tests/unit/scaling/test_scaling_optimal.py`; every row is also checked by "
             "`tests/unit/scaling/test_scaling_references.py`.", "",
             "## Preset sizes", "",
             f"Parameter counts of `densetrain.models.sizing.param_counts` (equal to the built "
             f"model's) against the size each source gives, asserted by `{PRESET_TEST}`.", "",
             *preset_table(), "",
             "## Claims that cannot be reproduced from what was disclosed", ""]
    for item in UNREPRODUCIBLE:
        lines.append(f"- **{item.claim}** ({item.paper}): {item.missing}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--write PATH`` writes the page (through a temporary name); ``--check PATH`` exits 1
    when PATH differs from what would be written."""
    from densetrain.scaling.results import atomic_write_text

    parser = argparse.ArgumentParser(prog="python -m densetrain.scaling.reproductions")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PATH")
    mode.add_argument("--check", metavar="PATH")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        atomic_write_text(Path(args.write), text)
        print(f"wrote {args.write}")
        return 0
    path = Path(args.check)
    if not path.is_file() or path.read_text() != text:
        print(f"{path} is stale: run python -m densetrain.scaling.reproductions --write {path}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
