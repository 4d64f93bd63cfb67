"""The bad-input campaign's kinds "non-finite factors" and "env limits" (scripts/bad_inputs.py) through the real
command line (a third of the cases, and every one that must run): each bad value refused with one `npllm: error:`
line naming the field or variable, the good ones run, and the summary counts no problem."""

from concurrent.futures import ThreadPoolExecutor

from tests_support import load_campaign


def named(case) -> str:
    """What the error line must name: the variable, or the config field (GGUF's rope_factors_long is long_factor)."""
    if case.kind == "env limits":
        return next(iter(case.env))
    for word in ("short", "long"):
        if word + "_factor" in case.name or f"rope_factors_{word}" in case.name:
            return word + "_factor"
    return "partial_rotary_factor"


def test_the_campaign_refuses_bad_rope_factors_and_limit_variables_by_name(tmp_path, capsys):
    campaign = load_campaign()
    (tmp_path / "files").mkdir()
    cases = campaign.rope_factor_cases(tmp_path / "files") + campaign.env_limit_cases(tmp_path / "files")
    assert {c.kind for c in cases} == {"non-finite factors", "env limits"}
    assert sum(c.expect == "ok" for c in cases) == 5  # partial_rotary_factor 1.0, 0.5 in both layouts; limits in range
    cases = [c for i, c in enumerate(cases) if i % 3 == 0 or c.expect == "ok"]  # a third: each run takes ~1 s
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: campaign.run_case(c, 120, tmp_path), cases))
    for r in results:
        assert r.problems == [], (r.case.name, r.stderr_tail)
        if r.case.expect == "error":
            last = r.stderr_tail.strip().splitlines()[-1]
            assert r.status == 2 and last.startswith("npllm: error: "), (r.case.name, r.stderr_tail)
            assert named(r.case) in last, (r.case.name, last)
    assert campaign.report(results, as_json=False) == 0
    capsys.readouterr()
