from llmops.objectives.metrics import exact_matches


def test_exact_match_compares_stripped_strings() -> None:
    assert exact_matches([" seven ", "six"], ["seven", "five"]) == [1.0, 0.0]
