"""The main job: `python -m humming_jax demo` passes and prints its table."""

import humming_jax.__main__ as cli


def test_demo_passes(capsys, monkeypatch):
    monkeypatch.delenv("HUMMING_JAX_BACKEND")  # as `make demo` runs it: off a GPU, the reference
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    for pipeline in ("humming_grouped", "humming_indexed", "batched_humming_grouped", "moonep"):
        assert pipeline in out
    assert "FAIL" not in out
    assert "reference" in out
    # Progress lines before the compiles.
    assert "compiling and timing the grouped pipeline" in out and "the MoonEP experts" in out
