import hashlib
import json
from pathlib import Path

import yaml

from llmops.data.synthetic import instruction_records, number_in_words, roman_numeral, write_example_data

REPO = Path(__file__).resolve().parents[2]


def test_number_words_and_roman_numerals() -> None:
    assert number_in_words(0) == "zero"
    assert number_in_words(40) == "forty"
    assert number_in_words(115) == "one hundred fifteen"
    assert number_in_words(9071) == "nine thousand seventy-one"
    assert roman_numeral(1994) == "MCMXCIV" and roman_numeral(3999) == "MMMCMXCIX"


def test_generation_is_deterministic() -> None:
    assert instruction_records(50, seed=3) == instruction_records(50, seed=3)
    assert instruction_records(50, seed=3) != instruction_records(50, seed=4)


def test_regenerated_example_data_is_the_version_data_dvc_pins(tmp_path: Path) -> None:
    """`llmops data init` can rebuild data/ on a fresh clone: the bytes hash to data.dvc's md5."""
    written = write_example_data(tmp_path)
    entries = [{"md5": hashlib.md5((tmp_path / relative).read_bytes()).hexdigest(),
                "relpath": relative.removeprefix("data/")} for relative in sorted(written)]
    # DVC's hash of a folder: the md5 of its sorted JSON listing, with a `.dir` suffix
    folder_md5 = hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"
    pinned = yaml.safe_load((REPO / "data.dvc").read_text())["outs"][0]["md5"]
    assert folder_md5 == pinned
