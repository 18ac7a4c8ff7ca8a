"""The main job: `python -m humming_jax demo` passes and prints its table."""

import humming_jax.__main__ as cli


def test_demo_passes(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    for pipeline in ("humming_grouped", "humming_indexed", "batched_humming_grouped", "moonep"):
        assert pipeline in out
    assert "FAIL" not in out
    # Progress lines before the compiles (tens of seconds in interpret mode).
    assert "compiling and timing the grouped pipeline" in out and "the MoonEP experts" in out
