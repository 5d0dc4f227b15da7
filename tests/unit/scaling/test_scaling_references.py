"""docs/reproductions.md and its one source, ``densetrain.scaling.references``: every published
number is reproduced within the tolerance its test allows, each names a test that exists, and
the committed page is what the generator writes."""

import re
from pathlib import Path

import pytest

from densetrain.scaling.references import REFERENCES, UNREPRODUCIBLE
from densetrain.scaling.reproductions import main, preset_rows, render

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("ref", REFERENCES, ids=lambda r: r.key)
def test_reference_is_reproduced_within_its_tolerance(ref):
    assert abs(float(ref.reproduce()) - ref.published) <= ref.tolerance, ref.key
    assert re.search(r"et al\. \d{4}", ref.paper) and ref.where


@pytest.mark.parametrize("ref", REFERENCES, ids=lambda r: r.key)
def test_reference_names_a_test_that_reads_it(ref):
    path, function = ref.test.split("::")
    text = (ROOT / path).read_text()
    assert re.search(rf"^def {function}\(", text, re.M), ref.test
    assert "densetrain.scaling import references" in text, path


def test_keys_are_unique_and_claims_say_what_is_missing():
    keys = [r.key for r in REFERENCES]
    assert len(keys) == len(set(keys))
    assert all(item.missing and item.paper for item in UNREPRODUCIBLE)


def test_preset_rows_are_within_their_accepted_band():
    rows = preset_rows()
    assert len(rows) > 40
    for name, _family, published, count, accepted in rows:
        band = 0.06 if "transformers" in accepted else 0.02
        if accepted.endswith("B"):
            assert abs(count - published) <= 0.01e9, name
        else:
            assert abs(count - published) / published <= band, name


def test_committed_page_is_the_generated_one(tmp_path, capsys):
    page = ROOT / "docs" / "reproductions.md"
    assert page.read_text() == render(), (
        "docs/reproductions.md is stale: python -m densetrain.scaling.reproductions --write "
        "docs/reproductions.md")
    assert main(["--check", str(page)]) == 0
    stale = tmp_path / "old.md"
    stale.write_text("old\n")
    assert main(["--check", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert main(["--write", str(stale)]) == 0 and stale.read_text() == render()
