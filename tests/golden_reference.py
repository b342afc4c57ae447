"""Comparing our golden verdicts with load_case.check_engine's (the reference checker), rule by rule."""

from dsflash.golden.rules import CaseVerdict


def flatten(rule: dict) -> dict:
    """The reference checker's rule dict with its nested lists spelled as our flat keys."""
    out = {}
    for key, value in rule.items():
        if key == "per_image":
            for k, image in enumerate(value):
                for what, numbers in image.items():
                    out.update({f"image{k}.{what}.{n}": v for n, v in numbers.items()})
        elif key == "per_layer_image_rows_agree":
            out.update({f"{key}.{layer}": v for layer, v in enumerate(value)})
        else:
            out[key] = value
    return out


def assert_same_as_reference(ours: CaseVerdict, theirs: dict) -> None:
    """Tier, failed and missing rules, every rule's pass/fail and every number the reference gives, to 1e-9."""
    assert ours.tier == theirs["tier"]
    assert ours.failed == theirs["failed"]
    assert ours.missing == theirs["missing"]
    assert set(ours.rules) == set(theirs["rules"])
    for name, ref_rule in theirs["rules"].items():
        mine = ours.rules[name]
        assert mine.passed == ref_rule["pass"], name
        for key, value in flatten(ref_rule).items():
            if key in ("pass", "bounds"):
                continue
            got = mine.numbers["faithful"] if key == "pass_faithful" else mine.numbers[key]
            if isinstance(value, bool) or value is None:
                assert got == value, (name, key, got, value)
            else:
                assert abs(got - value) <= 1e-9, (name, key, got, value)
        if "bounds" in ref_rule:
            assert mine.bounds == ref_rule["bounds"], name
