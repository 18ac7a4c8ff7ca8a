"""The GEMM benchmark and tuning sweep run end to end on a tiny problem (interpret
mode), so that GPU time is never spent finding a bug in the harness."""

import functools
import json

import jax
import numpy as np
import pytest

import humming_jax as hj
import humming_jax.__main__ as cli
from humming_jax import bench, timing, tuning


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "interpret")
    monkeypatch.setitem(bench.PROBLEMS, "tiny", (4, 64, 32, 2))
    # One timed sample a row (interpreted kernels: the harness is under test, not the times).
    monkeypatch.setattr(bench, "device_seconds", functools.partial(timing.device_seconds, repeats=1))


def test_bench_writes_json(tiny, tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert (
        cli.main(["bench", "--problems", "tiny", "--tokens", "3", "--formats", "bf16", "mxfp4", "--out", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["gemm"], r["layout"], r["fmt"]) for r in rows} == {
        (g, layout, f) for g in ("w13", "w2") for layout in ("grouped", "indexed") for f in ("bf16", "mxfp4")
    }
    for r in rows:
        assert r["error"] < 1e-2, r  # checked against ragged_dot on the dequantized weights
        assert r["us"] > 0 and r["gbps"] > 0 and 0 < r["roofline_fraction"]
    assert any(r.get("ragged_dot_us") for r in rows)
    # T=3 is decode-sized: each row carries the time of a pass over its bytes
    assert all(r["copy_us"] > 0 and r["vs_copy"] == pytest.approx(r["copy_us"] / r["us"]) for r in rows)
    assert "tiny" in capsys.readouterr().out
    # JAX's Mosaic GPU grouped GEMM is a GPU-only reference point: no row off the GPU.
    assert all(r.get("mgpu_ragged_dot_us") is None for r in rows)
    ids = np.zeros((512, 2), np.int32)
    assert bench.time_mgpu_ragged_dot(bench.Case("tiny", "w13", "grouped", 512, "bf16"), ids) is None


def test_tune_writes_a_table_the_loader_reads(tiny, tmp_path, monkeypatch):
    candidates = (tuning.TuningConfig(16, 32, 32), tuning.TuningConfig(16, 64, 64, swap_ab=True))
    monkeypatch.setattr(bench, "DECODE_CANDIDATES", candidates)
    monkeypatch.setattr(bench, "M_RANGES", ((0, 8),))
    out = tmp_path / "table.json"
    kept = dict(min_shape_m=8192, max_shape_m=16384, config=dict(block_m=128), us=[1.0])
    meta = dict(note="how the table was made")
    out.write_text(json.dumps(dict(meta=meta, entries={"indexed/4bit": [kept], "grouped_contiguous/16bit": [kept]})))
    assert cli.main(["tune", "--problem", "tiny", "--formats", "int4_g32", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["meta"]["note"] == meta["note"] and "tiny" in written["meta"]["tuned"][-1]  # history kept
    table = written["entries"]
    assert set(table) == {"grouped_contiguous/4bit", "indexed/4bit", "grouped_contiguous/16bit"}
    assert [e["min_shape_m"] for e in table["indexed/4bit"]] == [0, 8192]  # merged, ordered
    monkeypatch.setattr(tuning.resources, "files", lambda _: tmp_path)
    loaded = tuning.load_table("table.json")
    assert loaded["indexed/4bit"][0].config.block_m == 16


def test_tune_per_shape_entries_take_precedence(tiny, tmp_path, monkeypatch):
    """``tune --per-shape`` keys its entries by (E, N, K); choose_tuning prefers
    them to the class entries for that shape only."""
    from humming_jax.configs import GemmLayout
    from humming_jax.formats import get_format

    monkeypatch.setattr(bench, "DECODE_CANDIDATES", (tuning.TuningConfig(16, 32, 32, num_stages=2),))
    monkeypatch.setattr(bench, "M_RANGES", ((0, 8),))
    out = tmp_path / "table.json"
    generic = dict(min_shape_m=0, max_shape_m=8, config=dict(block_m=16, block_n=64, block_k=64), us=[1.0])
    out.write_text(json.dumps(dict(meta={}, entries={"grouped_contiguous/4bit": [generic]})))
    args = ["tune", "--problem", "tiny", "--formats", "int4_g32", "--layouts", "grouped", "--per-shape"]
    assert cli.main([*args, "--out", str(out)]) == 0
    e, n, k, _ = bench.Case("tiny", "w13", "grouped", 1, "int4_g32").shapes()
    shape_key = tuning.table_key("grouped_contiguous", "4bit", (e, n, k))
    assert set(json.loads(out.read_text())["entries"]) == {"grouped_contiguous/4bit", shape_key}
    monkeypatch.setattr(tuning.resources, "files", lambda _: tmp_path)
    monkeypatch.setattr(tuning, "_TABLE", tuning.load_table("table.json"))
    int4 = get_format("int4_g32")
    layout = GemmLayout.GROUPED_CONTIGUOUS
    assert tuning.choose_tuning(layout, int4, 6, e, n, k).num_stages == 2  # the shape's entry
    assert tuning.choose_tuning(layout, int4, 6, e, n, 2 * k).block_n == 64  # another shape: the class entry
    assert tuning.choose_tuning(layout, int4, 64, e, n, k) == tuning.heuristic_tuning(64 // e, n, k, "4bit")
    assert cli.main([*args, "--gemm", "w2", "--out", str(out)]) == 0  # w2's shape gets its own key
    e2, n2, k2, _ = bench.Case("tiny", "w2", "grouped", 1, "int4_g32").shapes()
    assert tuning.table_key("grouped_contiguous", "4bit", (e2, n2, k2)) in json.loads(out.read_text())["entries"]


@pytest.mark.parametrize(
    "entry,runs_mosaic",
    [
        (tuning.TuningConfig(128, 64, 64, num_stages=2, mosaic=True, split_rows=True), True),
        (tuning.TuningConfig(64, 128, 64, num_stages=2, mosaic=True), False),  # N=64 is off its tiles
    ],
    ids=["mosaic", "off-its-tiles"],
)
def test_bench_runs_the_tables_choice_as_gemm_does(tiny, monkeypatch, entry, runs_mosaic):
    """By default a bench row runs the table's entry through ``gemm`` — with
    its fallbacks — and records the tiling that ran: a Mosaic entry the call
    cannot take is timed (and recorded) as the Triton tile of its size."""
    monkeypatch.setattr(tuning, "choose_tuning", lambda *args: entry)

    def one_call(fn, sets):  # one interpreted call instead of the timing loop (seconds a call here)
        jax.block_until_ready(fn(*sets[0]))
        return 1e-3

    monkeypatch.setattr(bench, "device_seconds", one_call)
    row = bench.time_kernel(bench.Case("tiny", "w13", "grouped", 5, "bf16"))
    assert row["error"] < 1e-2
    ran = row["tuning"]
    assert ran["mosaic"] is runs_mosaic and (ran["block_m"], ran["block_n"]) == (entry.block_m, entry.block_n)
    assert ran["split_rows"] is runs_mosaic and (runs_mosaic or ran["num_warps"] == 8)


@pytest.mark.parametrize("layout_name", ["grouped", "indexed"])
def test_sampled_error_catches_a_wrong_output(tiny, layout_name):
    prep = bench.prepare(bench.Case("tiny", "w13", layout_name, 5, "int4_g32"))
    row, out, layout = bench.time_prepared(prep, tuning.TuningConfig(16, 32, 32))
    assert bench.sampled_error(prep, layout, out) < 1e-2
    assert bench.sampled_error(prep, layout, out * 1.1) > 5e-2
    assert bench.sampled_error(prep, layout, out.at[:, 0].add(1.0)) > 1e-2


def test_inspect_gemm_parses_configs():
    from benchmarks.inspect_gemm import parse_config

    assert parse_config("16,64,256,4,3,word_decode,fold_scales,split_k=2") == hj.TuningConfig(
        16, 64, 256, 4, 3, split_k=2, word_decode=True, fold_scales=True
    )
    with pytest.raises(ValueError, match="block_n"):
        parse_config("16,48,256,4,3")  # not a power of two


def test_launched_ops_lists_the_entry_computation(tiny):
    """What one call launches, read from the optimized module: a synthetic
    module's entry (a memset-like broadcast, a custom call, a tuple root), and
    a compiled bench call on this backend."""
    text = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
}

ENTRY %main (x: bf16[8,64]) -> (bf16[8,32], f32[]) {
  %x = bf16[8,64]{1,0} parameter(0)
  %zeros = bf16[8,32]{1,0} fusion(), kind=kLoop, calls=%fused
  %kernel = (bf16[8,32]{1,0}, f32[]) custom-call(bf16[8,64]{1,0} %x, bf16[8,32]{1,0} %zeros), custom_call_target="k"
  %out = bf16[8,32]{1,0} get-tuple-element((bf16[8,32]{1,0}, f32[]) %kernel), index=0
  ROOT %t = (bf16[8,32]{1,0}, f32[]) tuple(bf16[8,32]{1,0} %out, f32[] %kernel)
}
"""
    assert bench.launched_ops(text) == ["fusion %zeros", "custom-call %kernel"]
    prep = bench.prepare(bench.Case("tiny", "w2", "grouped", 3, "bf16"))
    fn, _ = bench.gemm_call(prep, None)
    ops = bench.launched_ops(jax.jit(fn).lower(prep.xs[0], prep.weights[0]).compile().as_text())
    assert ops and all(" " in op for op in ops)


def test_random_weight_in_expert_chunks(monkeypatch):
    """Large problems draw and quantize a few experts at a time: the joined
    weight is valid and each chunk is the quantized draw of its experts."""
    import jax
    import jax.numpy as jnp

    from humming_jax import formats as F

    e, n, k = 5, 32, 64
    monkeypatch.setattr(bench, "QUANTIZE_CHUNK_BYTES", 2 * 4 * n * k)  # two experts per chunk
    key = jax.random.key(3)
    weight = bench._random_weight(key, F.INT4_G32, e, n, k)
    weight.validate()
    assert weight.shape == (e, n, k) and weight.values.shape[0] == e
    last = F.quantize_weight(jax.random.normal(jax.random.fold_in(key, 4), (1, n, k), jnp.bfloat16) * 0.02, F.INT4_G32)
    np.testing.assert_array_equal(np.asarray(F.dequantize_weight(weight)[4:]), np.asarray(F.dequantize_weight(last)))
    assert len({float(jnp.std(F.dequantize_weight(weight)[i])) for i in range(e)}) == e  # no chunk repeated


def test_routing_bench_sweeps_row_tiles(monkeypatch):
    """The routing benchmark (interpret mode): one row per op and tiling, the
    references once, and the table pairs each tiling with its reference."""
    from benchmarks import bench_routing

    monkeypatch.setattr(bench_routing, "KERNEL", "interpret")
    tiles = hj.RowTilesConfig.parse("4x64x2")
    rows = bench_routing.bench((5,), ((4, 2),), (64,), row_tiles=(None, tiles))
    kernel_rows = [r for r in rows if r["backend"] == "interpret" and "H" in r]
    assert sorted((r["op"], r["row_tiles"]) for r in kernel_rows) == sorted(
        (op, name) for op in ("permute", "unpermute", "fused_mul_sum") for name in ("default", "4x64x2")
    )
    assert sum(r["backend"] == "reference" and "H" in r for r in rows) == 3
    assert bench_routing.table(rows).count("4x64x2") == 3


def test_process_input_bench_sweeps_tiles(monkeypatch):
    """The process_input benchmark (interpret mode): one kernel row per tiling,
    one reference row, and the table pairs each tiling with the reference."""
    from benchmarks import bench_process_input

    monkeypatch.setattr(bench_process_input, "KERNEL", "interpret")
    monkeypatch.setattr(bench_process_input, "TOP_K", 1)
    tiles = hj.ProcessTilesConfig.parse("2x2")
    rows = bench_process_input.bench((3,), (256,), ("silu+mxfp8",), tiles_list=(None, tiles))
    assert [(r["backend"], r.get("tiles")) for r in rows] == [
        ("interpret", "default"),
        ("interpret", "2x2"),
        ("reference", None),
    ]
    assert bench_process_input.table(rows).count("2x2") == 1
    # Both tilings against one same-run pass over as many bytes.
    kernel_rows = [r for r in rows if r["backend"] == "interpret"]
    assert kernel_rows[0]["copy_us"] == kernel_rows[1]["copy_us"] > 0
    assert all(r["vs_copy"] == r["copy_us"] / r["us"] for r in kernel_rows)


def test_process_input_bench_interleaves_rounds(monkeypatch):
    """``rounds`` > 1: kernel and copy timed in turn; the row keeps the median time
    and the per-round ratios to the copy (median within min and max), the table
    shows the median ratio and its range."""
    from benchmarks import bench_process_input

    monkeypatch.setattr(bench_process_input, "KERNEL", "interpret")
    monkeypatch.setattr(bench_process_input, "TOP_K", 1)
    rows = bench_process_input.bench((2,), (256,), ("silu+mxfp8",), rounds=2)
    kernel, reference = rows
    assert kernel["rounds"] == 2 and reference["backend"] == "reference"
    assert 0 < kernel["vs_copy_min"] <= kernel["vs_copy_median"] <= kernel["vs_copy_max"]
    assert "in 2 rounds" in bench_process_input.table(rows)


def test_merge_entry_replaces_overlapping_ranges():
    """A new (0, 16] entry replaces an older (0, 128] one: lookups take the
    first range holding M, so the wider old range would shadow it."""
    old = [dict(min_shape_m=0, max_shape_m=128, us=[9.0]), dict(min_shape_m=8192, max_shape_m=2**30, us=[1.0])]
    new = dict(min_shape_m=0, max_shape_m=16, us=[2.0])
    merged = bench.merge_entry(old, new)
    assert [(e["min_shape_m"], e["max_shape_m"]) for e in merged] == [(0, 16), (8192, 2**30)]
    merged = bench.merge_entry(merged, dict(min_shape_m=16, max_shape_m=128, us=[3.0]))
    assert [(e["min_shape_m"], e["max_shape_m"]) for e in merged] == [(0, 16), (16, 128), (8192, 2**30)]


def test_shipped_table_ranges_do_not_overlap():
    """Every key of the shipped H200 table has disjoint M ranges (else one
    entry silently shadows another)."""
    for key, entries in tuning.load_table().items():
        ranges = sorted((e.min_shape_m, e.max_shape_m) for e in entries)
        for (_, high), (low, _) in zip(ranges, ranges[1:], strict=False):
            assert high <= low, (key, ranges)


def test_candidates_by_rows_per_expert():
    """Split-K only where experts hold a row or two, 64-row tiles beside the
    decode ones for 17-32 rows, prefill tiles past that."""
    one, eight, thirty_two = (bench.candidates_for(rows) for rows in (1, 8, 32))
    assert any(c.split_k > 1 for c in one) and not any(c.split_k > 1 for c in eight + thirty_two)
    assert not any(c.block_m == 64 for c in eight)
    assert set(bench.MID_CANDIDATES) <= set(thirty_two)
    assert bench.candidates_for(64) == bench.PREFILL_CANDIDATES


def test_four_bit_heuristic_by_rows_and_format():
    """The heuristic's 4-bit tiles are the H200 winners: word + fold + pairs at
    16/32 rows, swap_ab prefill tiles at 64/128 rows, 256 columns for e2m1 on 128."""
    decode = tuning.heuristic_tuning(16, 1536, 2048, "4bit")
    assert (decode.block_m, decode.block_n, decode.block_k, decode.pair_decode) == (16, 128, 256, True)
    int4, fp4 = (tuning.heuristic_tuning(1024, 28672, 4096, c) for c in ("4bit", "fp4"))
    assert int4.swap_ab and fp4.swap_ab and (int4.block_m, int4.block_n, fp4.block_n) == (128, 128, 256)
    assert tuning.heuristic_tuning(64, 1536, 2048, "fp4").block_n == 128


def test_trace_rotation_summary(tmp_path):
    """The Mosaic rotation's trace report: region times a program per warpgroup
    role (trace ids 1 + warpgroup + 4 * program with 3 compute warpgroups) and
    one program's steps, from begin/end events."""
    import json

    from benchmarks import trace_rotation

    def span(name, tid, begin, end):
        return [
            {"name": name, "ph": "B", "ts": begin, "pid": 1, "tid": tid},
            {"name": name, "ph": "E", "ts": end, "pid": 1, "tid": tid},
        ]

    events = []
    for program in range(2):
        base = 1 + 4 * program
        events += span("max_step", base, 1.0, 4.0) + span("max_waits_load", base, 1.5, 2.0)
        events += span("quantize_step", base + 1, 4.0, 7.0) + span("quantize_step", base + 2, 4.0, 6.0)
        events += span("load_step", base + 3, 0.5, 3.0)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = trace_rotation.summarize(str(path), 3)
    assert "kernel span (first to last recorded event): 6.50 k cycles" in report
    assert "max max_waits_load" in report and "0.50 k cycles a program" in report
    assert " quantize 0 quantize_step             1.0 a program,    3.00 k cycles" in report
    assert " quantize 1 quantize_step             1.0 a program,    2.00 k cycles" in report
    assert "memory load_step                 1.0 a program,    2.50 k cycles" in report
    assert "   quantize 0 quantize_step     3.50 ..    6.50" in report  # program 0, from the first event
    assert report.count("_step ") == 4 + 4  # four roles' totals, then program 0's four steps
    # Without the memory warpgroup (self-fed rings): 3 trace ids a program.
    events = []
    for program in range(2):
        base = 1 + 3 * program
        events += span("max_step", base, 1.0, 4.0) + span("quantize_step", base + 1, 4.0, 7.0)
        events += span("quantize_step", base + 2, 4.0, 6.0)
    path.write_text(json.dumps({"traceEvents": events}))
    report = trace_rotation.summarize(str(path), 3, memory=False)
    assert " quantize 1 quantize_step             1.0 a program,    2.00 k cycles" in report
    assert "memory" not in report
    # The own-rings form: every warpgroup's own_step (both passes), 2 trace ids a program.
    events = []
    for program in range(2):
        events += span("own_step", 1 + 2 * program, 1.0, 5.0) + span("own_step", 2 + 2 * program, 1.0, 4.0)
    path.write_text(json.dumps({"traceEvents": events}))
    report = trace_rotation.summarize(str(path), 2, memory=False, own_rings=True)
    assert "      own 1 own_step                  1.0 a program,    3.00 k cycles" in report
    assert report.count("own_step") == 2 + 2


def test_ab_rotation_variants():
    """The interleaved A/B's variant text: a name, then MosaicRotation fields as literals."""
    from benchmarks import ab_rotation

    assert ab_rotation.parse_variant("base:") == ("base", {})
    assert ab_rotation.parse_variant("base") == ("base", {})
    name, options = ab_rotation.parse_variant("quiet:auto_barriers=False, select_store=True,first_ring=3")
    assert name == "quiet" and options == {"auto_barriers": False, "select_store": True, "first_ring": 3}
    with pytest.raises(ValueError, match="field=value"):
        ab_rotation.parse_variant("bad:first_ring")
    with pytest.raises(ValueError, match="name"):
        ab_rotation.parse_variant(":first_ring=3")
