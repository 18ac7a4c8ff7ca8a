"""The GEMM benchmark and tuning sweep run end to end on a tiny problem (interpret
mode), so that GPU time is never spent finding a bug in the harness."""

import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
import humming_jax.__main__ as cli
from humming_jax import backend, bench, routing, tiles_text, timing, tuning
from humming_jax import formats as F
from humming_jax import input_quant as Q
from humming_jax import layouts as L
from humming_jax.gemm import as_quantized_input, plan
from humming_jax.tuning import heuristic, search
from humming_jax.tuning import table as table_module
from pallas_kernels.gemm import mosaic, triton

from sweep import FULL, sweep

# The developer tools under benchmarks/ (A/B timings, sanitizer and soak harnesses, the call-form and
# per-op benches): their slower harness tests run under --full (make test-full, the GPU step); make test
# keeps the library's own entry points (bench, bench --layer, tune, report) and the shipped table.
TOOL = FULL


@pytest.fixture(autouse=True)
def quick_timing(monkeypatch):
    """Interpreted kernels: one iteration a timing, one calibration run."""
    monkeypatch.setattr(timing, "FIRST_ITERATIONS", 1)
    monkeypatch.setattr(timing, "ESTIMATE_RUNS", 1)


def _compiled_once(fn, sets, **_):
    """In place of ``device_seconds``: ``fn`` compiled and run once, not in a
    timing loop (which takes any function of arrays: test_bench_writes_json)."""
    jax.block_until_ready(jax.jit(fn)(*sets[0]))
    return 1e-3


def _sampled_once(fn, sets, **_):
    """In place of ``sampler``: ``fn`` run once, each sample a millisecond."""
    _compiled_once(fn, sets)
    return lambda repeats: 1e-3


@pytest.fixture
def compiled_once(monkeypatch):
    monkeypatch.setattr(bench, "device_seconds", _compiled_once)
    monkeypatch.setattr(bench, "sampler", _sampled_once)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "interpret")
    monkeypatch.setitem(bench.PROBLEMS, "tiny", (4, 64, 32, 2))
    # One timed sample a row (interpreted kernels: the harness is under test, not the times).
    monkeypatch.setattr(bench, "device_seconds", functools.partial(timing.device_seconds, repeats=1))
    monkeypatch.setattr(bench, "TIMING_REPEATS", 1)


def test_bench_writes_json(tiny, tmp_path, monkeypatch, capsys):
    # The harness is under test: the bench's kernel calls run interpreted below
    # (the table's choice, the sampled error, the quantized-input pair).
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "reference")
    out = tmp_path / "gemm.json"
    args = ["bench", "--problems", "tiny", "--tokens", "3", "--formats", "bf16", "--gemms", "w13", "--out", str(out)]
    assert cli.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    want = {("w13", layout, "bf16") for layout in ("grouped", "indexed")}
    assert {(r["gemm"], r["layout"], r["fmt"]) for r in rows} == want
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


def test_bench_reports_a_case_no_kernel_takes_and_runs_the_rest(tiny, tmp_path, monkeypatch, capsys):
    """A case no kernel takes is a failure the bench names (stderr, the JSON's
    ``failures``, exit status 1) while the other cases still run;
    ``run_bench`` without a failure list raises it."""
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "reference")
    timed = bench.time_kernel

    def refuse_indexed(case, **kwargs):
        if case.layout == "indexed":
            raise backend.NoKernelError("gemm: no kernel takes this call (a test's refusal)")
        return timed(case, **kwargs)

    monkeypatch.setattr(bench, "time_kernel", refuse_indexed)
    out = tmp_path / "gemm.json"
    args = ["bench", "--problems", "tiny", "--tokens", "3", "5", "--formats", "bf16", "--gemms", "w13", "--no-compare"]
    assert cli.main([*args, "--out", str(out)]) == 1
    written = json.loads(out.read_text())
    assert [(r["layout"], r["tokens"]) for r in written["rows"]] == [("grouped", 3), ("grouped", 5)]
    failed = written["meta"]["failures"]
    assert [(f["layout"], f["tokens"]) for f in failed] == [("indexed", 3), ("indexed", 5)]
    assert all("a test's refusal" in f["error"] for f in failed)
    assert "no kernel took tiny w13 indexed T=3 bf16" in capsys.readouterr().err
    with pytest.raises(backend.NoKernelError, match="a test's refusal"):
        bench.run_bench(["tiny"], [3], ["bf16"], layouts=["indexed"], gemms=["w13"], compare=False)


def test_layer_bench_torch_peer_out_of_memory_leaves_its_column_empty(monkeypatch, capsys):
    """Where torch's bf16 layer does not fit beside JAX's pool the peer's
    column is None and the bench says why, instead of failing the case."""
    import types

    from humming_jax import layer_bench

    class OutOfMemoryError(RuntimeError):
        pass

    emptied = []
    fake = types.SimpleNamespace(
        OutOfMemoryError=OutOfMemoryError,
        _grouped_mm=None,
        cuda=types.SimpleNamespace(is_available=lambda: True, empty_cache=lambda: emptied.append(True)),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)

    def too_big(torch, case, ids):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(layer_bench, "_torch_layer_us", too_big)
    case = layer_bench.LayerCase("deepseek-v3", "grouped", 1024, "int4_g128")
    assert layer_bench.time_torch_layer(case, np.zeros((1024, 8), np.int32)) is None
    assert "does not fit" in capsys.readouterr().out and emptied


def test_layer_bench_writes_json(tiny, compiled_once, tmp_path, monkeypatch, capsys):
    """``bench --layer``: each pipeline's layer time, its stages' times (the
    stages the pipeline runs), the share outside the GEMMs, the host time,
    checked against the reference pipeline; JSON and a plot."""
    from humming_jax import layer_bench

    monkeypatch.setattr(layer_bench, "HOST_CALLS", 2)
    monkeypatch.setattr(layer_bench, "INPUT_SETS", 1)
    # The harness is under test: the pipelines' kernels run interpreted in test_pipelines.
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "reference")
    out = tmp_path / "layer.json"
    args = ["bench", "--layer", "--problems", "tiny", "--tokens", "4", "--formats", "int4_g32"]
    assert cli.main([*args, "--pipelines", "grouped", "ep", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # (indexed: the same harness; its stages run in test_pipelines)
    assert [(r["pipeline"], r["fmt"]) for r in rows] == [("grouped", "int4_g32"), ("ep", "int4_g32")]
    grouped, ep = rows
    # Four simulated ranks, one token each: 2 slots of an int4 x bf16 row (2H bytes), its id, a bf16 row back.
    assert ep["ranks"] == 4 and ep["sent_bytes_per_rank"] == 2 * (2 * 64 + 4 + 2 * 64)
    # 3 of 4 ranks' rows cross a link: their bytes over the dispatch and combine time, against NVLink's peak.
    assert ep["link_bytes_per_rank"] == ep["sent_bytes_per_rank"] * 3 // 4
    exchange_us = ep["stage_us"]["dispatch"] + ep["stage_us"]["combine"]
    assert ep["exchange_gbps"] == pytest.approx(ep["link_bytes_per_rank"] / exchange_us / 1e3)
    assert ep["link_fraction"] == pytest.approx(ep["exchange_gbps"] / layer_bench.LINK_GBPS)
    assert list(ep["stage_us"]) == ["dispatch", "experts", "combine"] and all(v > 0 for v in ep["stage_us"].values())
    assert ep["gemm_us"] is None and ep["error"] < 1e-2 and ep["us"] > 0
    assert ep["redundant"] == 0 and ep["loads"] == ep["balanced_loads"] and sum(ep["loads"]) == 4 * 2
    for r in [grouped]:
        assert list(r["stage_us"]) == ["routing", "input", "w13", "activation", "w2", "combine"]
        assert all(us > 0 for us in r["stage_us"].values()) and r["us"] > 0 and r["gbps"] > 0
        assert r["gemm_us"] == pytest.approx(r["stage_us"]["w13"] + r["stage_us"]["w2"])
        assert 0 < r["outside_share"] < 1 and isinstance(r["host_us"], float)
        assert 0 < r["dispatch_us"] and 0 < r["pipelined_us"]
        assert r["error"] < 1e-2, r
        assert r["torch_layer_us"] is None  # no GPU here
        assert r["traced_outside_share"] is None and r["gemm_kernel_us"] is None  # no device kernels traced
    assert (tmp_path / "layer.png").stat().st_size > 0
    assert "tiny" in capsys.readouterr().out
    # --no-stages: the whole layer only (the pipeline compiled above is reused).
    assert cli.main([*args, "--pipelines", "grouped", "--no-stages", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["stage_us"] == {} and row["gemm_us"] is None and row["outside_share"] is None and row["us"] > 0


def test_traced_share_is_of_the_traced_span(monkeypatch):
    """The share outside the GEMM kernels is taken of the trace's own span
    (one state of the GPU's clocks), not of the chained layer's time."""
    from humming_jax import layer_bench

    seconds = {layer_bench.GEMM_KERNELS: 580e-6, "all": 690e-6, "busy": 688e-6, "span": 700e-6}
    fake = timing.TracedKernels(seconds=seconds, table=[{"name": "moe_gemm_x", "us": 580.0}])
    monkeypatch.setattr(layer_bench, "traced_kernels", lambda *args, **kwargs: fake)
    monkeypatch.setattr(layer_bench.jax, "default_backend", lambda: "gpu")
    case = layer_bench.LayerCase("tiny", "grouped", 4, "int4_g32")
    fields = layer_bench._traced_fields(case, None, [])
    assert fields["traced_outside_share"] == pytest.approx(1 - 580 / 700)
    assert fields["span_us"] == pytest.approx(700) and fields["traced_kernels"] == fake.table


def test_device_kernel_seconds_counts_device_kernels_only():
    """A kernel trace's device kernels by name prefix, per device process;
    host events of the same name (the launch's own span) are not counted."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "moe_gemm_grouped_contiguous_uint4", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "pid": 7, "name": "moe_gemm_grouped_contiguous_uint4", "ts": 100.0, "dur": 9.5},
        {"ph": "X", "pid": 7, "name": "moe_gemm_mosaic", "ts": 112.0, "dur": 4.5},
        {"ph": "X", "pid": 7, "name": "moe_process_input", "ts": 115.5, "dur": 2.0},  # overlaps the last by 1
        {"ph": "X", "pid": 7, "name": "loop_fusion", "ts": 120.0, "dur": 1.0},
        {"ph": "i", "pid": 7, "name": "moe_gemm_marker", "ts": 130.0},
    ]
    got = timing.device_kernel_seconds(events, ("moe_gemm", "moe_process"))
    # busy: 17 less the 1 µs of overlap; span: 100 to 121
    want = {"moe_gemm": 14e-6, "moe_process": 2e-6, "all": 17e-6, "busy": 16e-6, "span": 21e-6}
    assert got == pytest.approx(want)
    assert timing.device_kernel_seconds(events[:1] + events[2:3], ("moe_gemm",)) is None
    # by stream and name, a call of two: the longest first, host events left out
    streams = [{"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "Stream #3"}}]
    on_stream = [dict(e, tid=3) if e.get("pid") == 7 else e for e in events]
    table = timing.device_kernel_table(streams + on_stream + on_stream[3:4], calls=2)
    assert table[0] == dict(thread="Stream #3", name="moe_gemm_grouped_contiguous_uint4", launches=1.0, us=9.5)
    assert [r["name"] for r in table[1:]] == ["moe_gemm_mosaic", "moe_process_input", "loop_fusion"]
    assert table[1]["launches"] == 0.5 and table[1]["us"] == pytest.approx(2.25)


def test_traced_kernels_reads_a_real_trace(monkeypatch):
    """The profiler's trace of the looped function is written and read (its
    host events reach the parser): on the CPU it holds no device kernel, so
    None (the layer bench leaves its traced fields empty)."""
    seen, original = [], timing.device_kernel_seconds

    def spy(events, prefixes):
        seen.append(len(events))
        return original(events, prefixes)

    monkeypatch.setattr(timing, "device_kernel_seconds", spy)
    assert timing.traced_kernels(lambda x: x * 2, [(jnp.ones(8),)], ("moe_gemm",), calls=2) is None
    assert len(seen) == 1 and seen[0] > 0


@FULL  # the harness of test_layer_bench_writes_json on two more pipelines
def test_layer_bench_times_the_batched_and_moonep_layouts(tiny, compiled_once, tmp_path, monkeypatch, capsys):
    """The batched layout (each expert's rows gathered in a padded buffer, the
    reduce the caller's) and MoonEP's segment order (bf16 only: another format
    is skipped with a line) are timed stage by stage as the others are."""
    from humming_jax import layer_bench

    monkeypatch.setattr(layer_bench, "HOST_CALLS", 2)
    monkeypatch.setattr(layer_bench, "INPUT_SETS", 2)
    monkeypatch.setattr(bench, "KERNEL_BACKEND", "reference")  # the pipelines' kernels: test_pipelines
    out = tmp_path / "layer.json"
    args = ["bench", "--layer", "--problems", "tiny", "--tokens", "5", "--formats", "bf16", "int4_g32"]
    assert cli.main([*args, "--pipelines", "batched", "moonep", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pipeline"], r["fmt"]) for r in rows] == [
        ("batched", "bf16"),
        ("moonep", "bf16"),
        ("batched", "int4_g32"),
    ]
    assert "moonep skipped (MoonEP's experts are bf16 only)" in capsys.readouterr().out
    stages = {"batched": ["input", "w13", "activation", "w2"], "moonep": ["w13", "activation", "w2"]}
    for r in rows:
        assert list(r["stage_us"]) == stages[r["pipeline"]] and r["us"] > 0
        assert r["gemm_us"] == pytest.approx(r["stage_us"]["w13"] + r["stage_us"]["w2"]) and 0 < r["outside_share"] < 1
        assert r["error"] < 1e-2 and r["torch_layer_us"] is None
    assert rows[0]["batched_capacity"] == 16 and "batched_capacity" not in rows[1]
    # Every case skipped: an empty result, no plot (the plot of no panels raised).
    empty = tmp_path / "empty.json"
    assert cli.main([*args[:-2], "int4_g32", "--pipelines", "moonep", "--out", str(empty)]) == 0
    assert json.loads(empty.read_text())["rows"] == [] and not (tmp_path / "empty.png").exists()


def test_layer_bench_inputs_of_the_gathered_layouts(monkeypatch):
    """A routing's rows as the batched layout holds them (each expert's rows in
    slot order, NaN past its count in a buffer of the routings' largest count
    rounded up) and as MoonEP's segment order does (rows, segment ends, router
    weights in the same order)."""
    from humming_jax import layer_bench

    monkeypatch.setitem(bench.PROBLEMS, "tiny", (4, 8, 4, 2))
    ids = np.array([[2, 0], [2, 3], [0, 2]], np.int32)
    routing = dict(ids=ids, hidden=np.arange(24, dtype=np.float32).reshape(3, 8), topk_weights=np.full((3, 2), 0.5))
    routing["topk_weights"][1, 1] = 0.25
    assert layer_bench.batched_capacity([routing], 4) == bench.MASKED_ROW_MULTIPLE
    monkeypatch.setattr(bench, "MASKED_ROW_MULTIPLE", 2)
    assert layer_bench.batched_capacity([routing], 4) == 4  # expert 2: three rows
    batched = layer_bench._inputs(layer_bench.LayerCase("tiny", "batched", 3, "bf16"), routing, 4)
    assert np.asarray(batched["expert_num_tokens"]).tolist() == [2, 0, 3, 1]
    buffer = np.asarray(batched["hidden_states"], np.float32)
    for expert, tokens in ((0, [0, 2]), (2, [0, 1, 2]), (3, [1])):
        np.testing.assert_array_equal(buffer[expert, : len(tokens)], routing["hidden"][tokens])
        assert np.isnan(buffer[expert, len(tokens) :]).all()
    assert np.isnan(buffer[1]).all()
    moonep = layer_bench._inputs(layer_bench.LayerCase("tiny", "moonep", 3, "bf16"), routing)
    np.testing.assert_array_equal(
        np.asarray(moonep["hidden_states"], np.float32), routing["hidden"][[0, 2, 0, 1, 2, 1]]
    )
    assert np.asarray(moonep["cu_seqlens"]).tolist() == [2, 2, 5, 6]
    assert np.asarray(moonep["route_weights"]).tolist() == [0.5, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_bench_quantized_input_pairs_with_the_anchor(tiny, compiled_once, tmp_path, monkeypatch):
    """A weight@input pair (or the anchor's name for it) quantizes the input
    (timed apart: ``quant_us``) and is compared with the anchor's time."""
    monkeypatch.setitem(bench.PROBLEMS, "tiny128", (4, 128, 128, 2))
    anchor = tmp_path / "anchor.json"
    humming = dict(kind="humming", shape="tiny128", gemm_type="grouped_contiguous", sublayer="w13", T=3)
    anchor.write_text(json.dumps({"results": [dict(humming, format="w8a8_fp8_block128", ms=0.004, ms_graph=0.002)]}))
    rows = bench.run_bench(
        ["tiny128"],
        [3],
        ["w8a8_fp8_block128"],
        layouts=("grouped",),
        gemms=("w13",),
        compare=False,
        anchor=bench.load_anchor(str(anchor)),
    )
    assert [r["fmt"] for r in rows] == ["w8a8_fp8_block128"]
    for r in rows:
        assert r["error"] < 1e-2, r
        assert r["quant_us"] > 0 and r["tiles"].startswith("triton:")
    assert rows[0]["humming_us"] == pytest.approx(2.0)
    assert rows[0]["x_humming"] == pytest.approx(rows[0]["us"] / 2.0)
    pair = "fp8_block128@fp8_dynamic_group128"
    assert list(bench.load_anchor(str(anchor))) == [("tiny128", "grouped", "w13", 3, pair)]
    assert bench.load_anchor(str(tmp_path / "absent.json")) == {}


@FULL  # make test's time: tune's other tests write and read entries too (test-full, the GPU step)
def test_tune_writes_a_table_the_loader_reads(tiny, compiled_once, tmp_path, monkeypatch):
    """``tune`` writes entries only (the kernel, its tiles, the time, the
    results file), merged into the file at ``--out``; the loader reads them back."""
    candidates = (triton.Tiles(16, 32, 32), triton.Tiles(16, 64, 64, swap_ab=True))
    monkeypatch.setattr(search, "DECODE", candidates)
    monkeypatch.setattr(search, "M_RANGES", ((0, 8),))
    out = tmp_path / "table.json"
    kept = dict(min_shape_m=8192, max_shape_m=16384, impl="mosaic", tiles=dict(stages=3), us=1.0, source="x.json")
    out.write_text(json.dumps(dict(entries={"indexed/4bit": [kept], "grouped_contiguous/16bit": [kept]})))
    assert cli.main(["tune", "--problem", "tiny", "--formats", "int4_g32", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    table = written["entries"]
    assert set(written) == {"device", "entries"}
    assert set(table) == {"grouped_contiguous/4bit", "indexed/4bit", "grouped_contiguous/16bit"}
    assert [e["min_shape_m"] for e in table["indexed/4bit"]] == [0, 8192]  # merged, ordered
    entry = table["indexed/4bit"][0]
    assert entry["impl"] == "triton" and entry["us"] > 0 and entry["source"] == str(out)
    loaded = table_module.parse_table(out.read_text())
    assert loaded["indexed/4bit"][0].tiles in candidates
    assert loaded["indexed/4bit"][1].tiles == mosaic.Tiles(stages=3)


def test_tune_per_shape_entries_take_precedence(tiny, compiled_once, tmp_path, monkeypatch):
    """``tune --per-shape`` keys its entries by (E, N, K); the candidates list
    them before the class entries, for that shape only, then the heuristic's."""
    from humming_jax.formats import get_format

    monkeypatch.setattr(search, "DECODE", (triton.Tiles(16, 32, 32, num_stages=2),))
    monkeypatch.setattr(search, "M_RANGES", ((0, 8),))
    out = tmp_path / "table.json"
    generic = dict(min_shape_m=0, max_shape_m=8, impl="triton", tiles=dict(block_m=16, block_n=64), us=1.0)
    out.write_text(json.dumps(dict(entries={"grouped_contiguous/4bit": [generic]})))
    args = ["tune", "--problem", "tiny", "--formats", "int4_g32", "--layouts", "grouped", "--per-shape"]
    assert cli.main([*args, "--out", str(out)]) == 0
    e, n, k, _ = bench.Case("tiny", "w13", "grouped", 1, "int4_g32").shapes()
    shape_key = tuning.table_key("grouped_contiguous", "4bit", (e, n, k))
    assert set(json.loads(out.read_text())["entries"]) == {"grouped_contiguous/4bit", shape_key}
    monkeypatch.setattr(table_module, "load_table", lambda *a: table_module.parse_table(out.read_text()))
    int4 = get_format("int4_g32")
    shape, heuristic_tile = tuning.candidates("grouped_contiguous", int4, 6, e, n, k)
    assert shape.num_stages == 2  # the shape's entry, then the heuristic's (not the class's)
    assert heuristic_tile == heuristic.heuristic_candidates(6 // e or 1, n, k, int4)[0]
    assert tuning.candidates("grouped_contiguous", int4, 6, e, n, 2 * k)[0].block_n == 64  # another shape
    assert tuning.candidates("grouped_contiguous", int4, 64, e, n, k) == heuristic.heuristic_candidates(
        64 // e, n, k, int4
    )
    assert cli.main([*args, "--gemm", "w2", "--out", str(out)]) == 0  # w2's shape gets its own key
    e2, n2, k2, _ = bench.Case("tiny", "w2", "grouped", 1, "int4_g32").shapes()
    assert tuning.table_key("grouped_contiguous", "4bit", (e2, n2, k2)) in json.loads(out.read_text())["entries"]


@pytest.mark.parametrize(
    "entry,runs",
    [
        (mosaic.Tiles(64, 128, 64, stages=2, group_m=2), "mosaic:block_m=64,block_n=128,stages=2,group_m=2"),
        (mosaic.Tiles(64, 256, 64, stages=2), "triton:block_m=16,block_n=64,block_k=128"),  # N=128: off its tiles
    ],
    ids=["mosaic", "off-its-tiles"],
)
def test_bench_runs_the_tables_choice_as_gemm_does(tiny, monkeypatch, entry, runs):
    """By default a bench row runs the table's entry through ``gemm`` and
    records the tiling that ran: a Mosaic entry the call cannot take gives way
    to the heuristic's Triton tile, which the row names."""
    monkeypatch.setitem(bench.PROBLEMS, "tiny", (4, 128, 64, 2))  # w13: N=128, K=128
    monkeypatch.setattr(table_module, "table_entries", lambda *args: [tuning.Entry(0, 1 << 30, entry)])
    monkeypatch.setattr(tuning, "table_entries", table_module.table_entries)

    def one_call(fn, sets):  # one interpreted call instead of the timing loop (seconds a call here)
        jax.block_until_ready(fn(*sets[0]))
        return lambda repeats: 1e-3

    monkeypatch.setattr(bench, "sampler", one_call)
    row = bench.time_kernel(bench.Case("tiny", "w13", "grouped", 5, "bf16"))
    assert row["error"] < 1e-2
    assert row["tiles"] == runs


@pytest.mark.parametrize("layout_name", sweep(["grouped", "indexed"], ["grouped"]))
def test_sampled_error_catches_a_wrong_output(tiny, layout_name):
    prep = bench.prepare(bench.Case("tiny", "w13", layout_name, 5, "int4_g32"))
    row, out, layout = bench.time_prepared(prep, triton.Tiles(16, 32, 32))
    assert bench.sampled_error(prep, layout, out) < 1e-2
    assert bench.sampled_error(prep, layout, out * 1.1) > 5e-2
    assert bench.sampled_error(prep, layout, out.at[:, 0].add(1.0)) > 1e-2


def test_masked_case_is_the_batched_layout(tiny, compiled_once, tmp_path, monkeypatch):
    """A masked case times the batched experts' GEMM: an ``[E · capacity, K]``
    buffer (the largest count rounded up to 16), each expert's count of rows
    first in its block, the rest never read (NaN there changes nothing); its
    sampled error checks those rows; ``tune --layouts masked`` keys its
    entries by the masked layout, which the candidates then list first."""
    prep = bench.prepare(bench.Case("tiny", "w13", "masked", 5, "int4_g32"))
    e = bench.PROBLEMS["tiny"][0]
    counts = np.bincount(prep.ids.reshape(-1), minlength=e)
    capacity = bench.masked_capacity(prep.ids, e)
    assert capacity % 16 == 0 and capacity >= counts.max() and prep.xs[0].shape[0] == e * capacity
    unread = np.arange(capacity)[None, :] >= counts[:, None]
    poisoned = prep.xs[0].reshape(e, capacity, -1).at[jnp.asarray(unread)].set(jnp.nan).reshape(e * capacity, -1)
    prep.xs[0] = poisoned
    row, out, layout = bench.time_prepared(prep, triton.Tiles(16, 32, 32))
    assert isinstance(layout, hj.GroupedMasked) and np.array_equal(np.asarray(layout.expert_num_tokens), counts)
    got = np.asarray(out, np.float32).reshape(e, capacity, -1)
    assert np.all(np.isfinite(got)) and np.all(got[unread] == 0)
    assert bench.sampled_error(prep, layout, out) < 1e-2
    assert bench.sampled_error(prep, layout, out * 1.1) > 5e-2
    assert "humming_us" not in row or row["humming_us"] is None
    monkeypatch.setattr(search, "DECODE", (triton.Tiles(16, 32, 32, num_stages=2),))
    monkeypatch.setattr(search, "M_RANGES", ((0, 16),))
    out_file = tmp_path / "table.json"
    args = ["tune", "--problem", "tiny", "--formats", "int4_g32", "--layouts", "masked", "--out", str(out_file)]
    assert cli.main(args) == 0
    assert set(json.loads(out_file.read_text())["entries"]) == {"grouped_masked/4bit"}
    monkeypatch.setattr(table_module, "load_table", lambda *a: table_module.parse_table(out_file.read_text()))
    _, n, k, _ = prep.case.shapes()
    first = tuning.candidates("grouped_masked", hj.get_format("int4_g32"), 10, e, n, k)[0]
    assert first == triton.Tiles(16, 32, 32, num_stages=2)


def test_inspect_gemm_parses_configs():
    from benchmarks.inspect_gemm import parse_config

    text = "triton:block_m=16,block_n=64,block_k=256,split_k=2,word_decode=1,fold_scales=1"
    tiles = triton.Tiles(16, 64, 256, split_k=2, word_decode=True, fold_scales=True)
    assert parse_config(text) == tiles and tiles_text.gemm_to_text(tiles) == text
    assert parse_config("mosaic:stages=3,cluster_n=2") == mosaic.Tiles(stages=3, cluster_n=2)
    assert parse_config("block_m=16") == triton.Tiles(block_m=16)  # a bare field list: the Triton kernel
    with pytest.raises(ValueError, match="block_n"):
        parse_config("triton:block_n=48")  # not a power of two
    with pytest.raises(ValueError, match="kernel must be one of triton, mosaic"):
        parse_config("cuda:block_m=16")
    with pytest.raises(ValueError, match="names from block_m"):
        parse_config("triton:column_tiles=2")  # an option that no longer exists


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
    last = F.quantize_weight(bench.random_bf16(jax.random.fold_in(key, 4), (1, n, k), 0.02), F.INT4_G32)
    np.testing.assert_array_equal(np.asarray(F.dequantize_weight(weight)[4:]), np.asarray(F.dequantize_weight(last)))
    assert len({float(jnp.std(F.dequantize_weight(weight)[i])) for i in range(e)}) == e  # no chunk repeated


@TOOL
def test_routing_bench_sweeps_row_tiles(monkeypatch):
    """The routing benchmark (interpret mode): one row per op and tiling, the
    references once, and the table pairs each tiling with its reference."""
    from benchmarks import bench_routing

    monkeypatch.setattr(bench_routing, "device_seconds", _compiled_once)

    monkeypatch.setattr(bench_routing, "KERNEL", "interpret")
    from pallas_kernels.routing import RowTiles

    tiles = tiles_text.from_text(RowTiles, "block_tokens=4,block_cols=64,num_warps=2")
    name = "block_cols=64,num_warps=2"
    rows = bench_routing.bench((5,), ((4, 2),), (64,), row_tiles=(None, tiles))
    kernel_rows = [r for r in rows if r["backend"] == "interpret" and "H" in r]
    assert sorted((r["op"], r["row_tiles"]) for r in kernel_rows) == sorted(
        (op, tiling) for op in ("permute", "unpermute", "fused_mul_sum") for tiling in ("default", name)
    )
    assert sum(r["backend"] == "reference" and "H" in r for r in rows) == 3
    assert bench_routing.table(rows).count(name) == 3


@TOOL
def test_process_input_bench_sweeps_tiles(monkeypatch):
    """The process_input benchmark (interpret mode): one kernel row per tiling,
    one reference row, and the table pairs each tiling with the reference."""
    from benchmarks import bench_process_input

    monkeypatch.setattr(bench_process_input, "KERNEL", "interpret")
    monkeypatch.setattr(bench_process_input, "TOP_K", 1)
    from pallas_kernels.process_input import Tiles

    tiles = Tiles(2, 2)
    rows = bench_process_input.bench((3,), (256,), ("silu+mxfp8",), tiles_list=(None, tiles))
    assert [(r["backend"], r.get("tiles")) for r in rows] == [
        ("interpret", "default"),
        ("interpret", "block_rows=2,num_warps=2"),
        ("reference", None),
    ]
    assert bench_process_input.table(rows).count("block_rows=2,num_warps=2") == 1
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
    rows = bench_process_input.bench((3,), (256,), ("silu+mxfp8",), rounds=2)  # T as above: the same programs
    kernel, reference = rows
    assert kernel["rounds"] == 2 and reference["backend"] == "reference"
    assert 0 < kernel["vs_copy_min"] <= kernel["vs_copy_median"] <= kernel["vs_copy_max"]
    assert "in 2 rounds" in bench_process_input.table(rows)


@TOOL
def test_process_input_bench_has_the_w8a8_layers_activation(monkeypatch):
    """The case of W8A8's w2 input as its layer runs it (w13's tiles apply
    the activation on gate and up interleaved by 64 rows, the kernel-order
    fp8 block weights'; the pass quantizes) times the kernel and the
    reference."""
    from benchmarks import bench_process_input

    monkeypatch.setattr(bench_process_input, "KERNEL", "interpret")
    monkeypatch.setattr(bench_process_input, "TOP_K", 1)
    assert F.GATE_UP_BLOCK == 64 and bench_process_input.CASES["none+fp8_group128"][0] is None
    rows = bench_process_input.bench((3,), (256,), ("none+fp8_group128",))
    assert [r["backend"] for r in rows] == ["interpret", "reference"] and all(r["us"] > 0 for r in rows)


def test_tune_lists_the_ranges_the_table_leaves_to_the_heuristic(capsys, tmp_path, monkeypatch):
    """``tune --uncovered`` (no GPU): each (format, layout, M range) of the
    problem's GEMM with no entry in the table in use, and range flags that
    sweep that range alone; a range with an entry is not listed; an indexed
    range the indexed pipeline leaves to the grouped stages says so."""
    entry = dict(min_shape_m=1024, max_shape_m=8192, impl="triton", tiles=dict(block_m=32), us=1.0, source="mine")
    table = dict(meta={}, entries={"grouped_contiguous/4bit@E=128,N=2048,K=768": [entry]})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(tuning.table.TABLE_ENV, str(path))
    lines = bench.uncovered("qwen3-30b-a3b", "w2", ["int4_g128"], ["grouped"])
    # T=128 (8 rows an expert) has no entry; T=512 and T=1024 have.
    assert any("M in (128, 1024] (T=128)" in line for line in lines), lines
    assert not any("(T=512)" in line or "(4096, 8192]" in line for line in lines), lines
    assert any("(8192, 16384]" in line for line in lines), lines
    for line in lines:
        low, high = (int(v) for v in line.split("M in (")[1].split("]")[0].split(", "))
        flag = int(line.rsplit("--max-m ", 1)[1])
        assert search.swept_ranges(flag, flag) == ((low, high),), line  # this range alone
    assert cli.main(["tune", "--uncovered", "--problem", "qwen3-30b-a3b", "--formats", "int4_g128"]) == 0
    assert "(128, 1024]" in capsys.readouterr().out
    # gpt-oss-120b's K = 2880 takes MXFP4 (32-groups), not int4 g128: only MXFP4's ranges are listed.
    lines = bench.uncovered("gpt-oss-120b", "w2", ["int4_g128", "mxfp4"], ["grouped", "indexed"])
    assert lines and all(" mxfp4 " in line for line in lines), lines
    # From 32 rows an expert (T=1024) the indexed pipeline runs the grouped stages: its lines say so.
    runs_grouped = [line for line in lines if line.endswith("the indexed pipeline runs the grouped stages here")]
    assert runs_grouped and all(" indexed " in line for line in runs_grouped), lines
    assert any("(T=1024)" in line for line in runs_grouped), runs_grouped
    assert not any("(T=256)" in line for line in runs_grouped), runs_grouped


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
    for key, entries in tuning.load_table("h200.json").items():
        ranges = sorted((e.min_shape_m, e.max_shape_m) for e in entries)
        for (_, high), (low, _) in zip(ranges, ranges[1:], strict=False):
            assert high <= low, (key, ranges)


def test_shipped_table_entries_are_in_the_search_space():
    """Every tiling the shipped table runs is one ``tune`` sweeps (a rerun can
    reproduce the table), and each entry names its source."""
    expert_sized = {t for rows in range(17, 4097) for t in search.expert_sized(rows)}
    swept = set(search.DECODE + search.MID + search.PREFILL) | expert_sized
    for key, entries in tuning.load_table("h200.json").items():
        for entry in entries:
            assert entry.tiles in swept, (key, tiles_text.gemm_to_text(entry.tiles))
            assert entry.us and entry.source


def test_tune_ranges_cover_every_m_once():
    """The tune's M ranges tile (0, 2**30] without gaps; each is swept at its
    top (the open one at twice its bottom), so the anchor's T=4096 at top-8
    (M=32768) is a range's own point."""
    ranges = search.M_RANGES
    assert ranges[0][0] == 0 and ranges[-1][1] == 1 << 30
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    points = [search.representative_m(low, high) for low, high in ranges]
    assert all(low < m <= high for (low, high), m in zip(ranges, points, strict=True))
    assert 32768 in points and points[-1] == 65536


def test_candidates_by_rows_per_expert():
    """Split-K only where experts hold a row or two, 64-row tiles beside the
    decode ones for 17-32 rows, prefill tiles past that (with swap tiles sized
    to the experts' rows)."""
    one, eight, thirty_two = (search.candidates_for(rows) for rows in (1, 8, 32))
    split = lambda c: getattr(c, "split_k", 1) > 1  # noqa: E731  (Mosaic tiles never split K)
    assert any(map(split, one)) and not any(map(split, eight + thirty_two))
    # and for 8-bit weights, which refuse the 4-bit decode options
    assert any(split(c) and not (c.word_decode or c.pair_decode or c.swap_ab) for c in one)
    assert not any(c.block_m == 64 for c in eight)
    assert set(search.MID) <= set(thirty_two)
    assert search.candidates_for(64)[: len(search.PREFILL)] == search.PREFILL
    # and the swap tiles sized to the experts' rows (x's rows the wgmma's N), where not 128
    sized = search.candidates_for(256)[len(search.PREFILL) :]
    expected = [(144, True, False), (144, True, True), (160, True, False)]
    assert [(t.block_m, t.swap_ab, t.dequantize_input) for t in sized] == expected
    assert [search.expert_sized_rows(r) for r in (33, 64, 128, 256, 4096)] == [40, 72, 144, 144, 144]
    # 113 x 1.125 -> 128: the table's tile, and one 16 rows taller (few experts: one wave, not two)
    assert [t.block_m for t in search.expert_sized(113)] == [144]
    assert search.expert_sized(32)[0].cluster_n == 1  # 40 rows: five 8-row pieces, no cluster pair
    assert search.expert_sized(128)[2] == search.TALL_TILES[0]  # mixtral T=512's entry is swept
    # experts of many row tiles (mixtral at T=4096: 1024 rows) also sweep the tallest tiles
    assert [t.block_m for t in search.expert_sized(1024)] == [144, 144, 160, 176]
    assert search.TALL_TILES[1] not in search.expert_sized(512)  # the 2-stage 176 rows: past 512 only


def test_masked_layout_takes_the_contiguous_layouts_entries():
    """The batched (masked) layout has no entries of its own: it takes the
    contiguous layout's, shape's and class's, before the heuristic — at
    decode the tuned 64-column swap tile, not the heuristic's 128 columns
    (half the working programs on a few experts' weights)."""
    fmt = F.get_format("int4_g128")
    for rows in (8, 128, 32768):
        masked = tuning.candidates("grouped_masked", fmt, rows, 128, 1536, 2048)
        contiguous = tuning.candidates("grouped_contiguous", fmt, rows, 128, 1536, 2048)
        assert masked[0] == contiguous[0]
    entry = tuning.table_entries("grouped_masked", fmt, 8, 128, 1536, 2048)[0]
    assert entry.tiles.swap_ab and entry.tiles.block_n == 64
    assert tuning.table_entries("grouped_masked", F.get_format("bf16"), 8, 1, 16, 16) == tuning.table_entries(
        "grouped_contiguous", F.get_format("bf16"), 8, 1, 16, 16
    )


def test_four_bit_heuristic_by_rows_and_format():
    """The heuristic's 4-bit tiles are the H200 winners: word + fold + pairs at
    16/32 rows, swap_ab prefill tiles at 64/128 rows, 256 columns for e2m1 on
    128; from 128 rows an expert the Mosaic tile decoding planar codes ahead
    of them, and from 512 the dequantize-first one (for weights it does not
    decode) after it; an indexed layout's block size as the rows of a tile."""
    from humming_jax.formats import get_format

    decode = heuristic.triton_tiles(16, 1536, 2048, "4bit")
    assert (decode.block_m, decode.block_n, decode.block_k, decode.pair_decode) == (16, 128, 256, True)
    int4, fp4 = (heuristic.triton_tiles(1024, 28672, 4096, c) for c in ("4bit", "fp4"))
    assert int4.swap_ab and fp4.swap_ab and (int4.block_m, int4.block_n, fp4.block_n) == (128, 128, 256)
    assert heuristic.triton_tiles(64, 1536, 2048, "fp4").block_n == 128
    many = heuristic.heuristic_candidates(1024, 28672, 4096, get_format("int4_g128"))
    assert many[0] == heuristic.decode_tiles(1024, 1) and many[1].dequantize_first and many[2] == int4
    mid = heuristic.heuristic_candidates(128, 28672, 4096, get_format("int4_g128"))
    assert mid == [heuristic.decode_tiles(128, 1), heuristic.triton_tiles(128, 28672, 4096, "4bit")]
    # the decoding tile's rows fit the experts': 144 at 128 and 1024 rows an expert (eight tiles), 160
    # at 128 with few experts (one tile), 128 on an indexed block of 128
    sized = {(r, e): heuristic.decode_tiles(r, e).block_m for r in (128, 1024) for e in (1, 8, 128)}
    assert sized == {(128, 8): 160, (128, 128): 144, (1024, 8): 144, (1024, 128): 144, (128, 1): 128, (1024, 1): 128}
    # past the cap the rows split evenly: 180 in two tiles of 104 (a 160-row one would leave 20 for a second)
    assert [heuristic.decode_tiles(r, 128).block_m for r in (150, 160, 180)] == [160, 160, 104]
    assert heuristic.heuristic_candidates(128, 28672, 4096, get_format("int4_g128"), 128)[0].block_m == 128
    assert heuristic.heuristic_candidates(64, 1536, 2048, get_format("int4_g128"))[0] == heuristic.triton_tiles(
        64, 1536, 2048, "4bit"
    )
    # 32-127 rows an expert with many experts: one warpgroup a program (mosaic_mid), 48 or 64 rows; past
    # 64 rows the 128-row decoding tile (two mid tiles would decode each weight tile twice)
    for fmt in ("int4_g128", "mxfp4"):
        by_rows = [
            heuristic.heuristic_candidates(r, 1536, 2048, get_format(fmt), num_experts=128)[0] for r in (32, 64, 96)
        ]
        assert by_rows == [heuristic.MID_48, heuristic.MID_64, heuristic.DECODE_MOSAIC]
        assert heuristic.heuristic_candidates(16, 1536, 2048, get_format(fmt), num_experts=128)[0].block_m == 16
    # mixtral's 8 experts: the K loop decides, on the warp-specialized 48-row pair up to 48 rows an expert
    few = heuristic.heuristic_candidates(32, 28672, 4096, get_format("int4_g128"), num_experts=8)
    assert few == [heuristic.PAIR_48, heuristic.triton_tiles(32, 28672, 4096, "4bit")]
    assert heuristic.heuristic_candidates(64, 28672, 4096, get_format("int4_g128"), num_experts=8)[0].block_m == 64
    assert heuristic.heuristic_candidates(16, 1536, 2048, get_format("int4_g128")) == [decode]
    indexed = heuristic.heuristic_candidates(16, 1536, 2048, get_format("int4_g128"), block_size=64)
    assert indexed == [dataclasses.replace(decode, block_m=64)]
    (small,) = heuristic.heuristic_candidates(16, 1536, 2048, get_format("bf16"), block_size=8)
    assert small.block_m == 8 and not small.use_mma


def test_quantized_input_heuristic_by_input_dtype():
    """With fp8 inputs, int4 codes from 32 rows an expert keep their scales out
    of the tile (e4m3 products); with int8 inputs and for e2m1 codes the
    folded tile stays; the input's dtype names the class."""
    from humming_jax.formats import get_format

    int4, mx = get_format("int4_g128"), get_format("mxfp4")
    for rows in (32, 256):
        (fp8,) = heuristic.heuristic_candidates(rows, 1536, 2048, int4, input_dtype="float8_e4m3")
        assert (fp8.block_m, fp8.swap_ab, fp8.fold_scales, fp8.pair_decode) == (64, True, False, True)
        (int8,) = heuristic.heuristic_candidates(rows, 1536, 2048, int4, input_dtype="int8")
        assert int8.fold_scales and int8.block_m == min(rows, 64)
        # After the fp8 Mosaic kernel (the e4m3 copy from E4M3_COPY_MIN_ROWS; then, decoding planar
        # MXFP4 itself, the register-operand form and the staged one): the Triton tile.
        *mosaic, e2m1 = heuristic.heuristic_candidates(rows, 1536, 2048, mx, half_bits=True, input_dtype="float8_e4m3")
        copy = rows >= heuristic.E4M3_COPY_MIN_ROWS
        assert e2m1.fold_scales and len(mosaic) == (2 if rows < heuristic.DECODE_MOSAIC_MIN_ROWS else 1) + copy
        assert (mosaic[0] == heuristic.E4M3_COPY) == copy
    (decode,) = heuristic.heuristic_candidates(16, 1536, 2048, int4, input_dtype="float8_e4m3")
    assert decode.fold_scales and decode.block_k == 256
    assert [tuning.format_class(int4, d) for d in ("float8_e5m2", "int8", "float4_e2m1")] == [
        "4bit-a8",
        "4bit-i8",
        "4bit-a4",
    ]
    with pytest.raises(ValueError, match="input_dtype"):
        tuning.format_class(int4, "int4")


@TOOL
def test_soak_case_checks_the_kernel_path(monkeypatch):
    """One soak case end to end (hostile routing, a NaN token), and a kernel
    path that is wrong is reported as failed."""
    from benchmarks import soak

    case = dict(
        index=0,
        fmt="bf16",
        quant="none",
        bound=2e-2,
        pipeline="grouped",
        tokens=5,
        hot=True,
        out_of_range=True,
        expert_map=True,
        nan_tokens=1,
        seed=3,
    )
    result = soak.run_case(case, "interpret")
    assert result["ok"] and result["error"] < 1e-2
    assert soak.run_case({**case, "tokens": 0, "nan_tokens": 0, "pipeline": "indexed"}, "interpret")["ok"]
    real = hj.humming_grouped_experts
    wrong = lambda *a, backend=None: real(*a, backend=backend) * (1.0 if backend == "reference" else 1.1)  # noqa: E731
    monkeypatch.setattr(hj, "humming_grouped_experts", wrong)
    assert not soak.run_case(case, "interpret")["ok"]


@TOOL
@pytest.mark.bounds
def test_hostile_gemms_checks_every_layout(monkeypatch):
    """The sanitizer step's calls (offsets far outside the rows, one expert
    owning all, ids outside [0, E), a block a slot with int32's extreme ids,
    the same tiled by expert) pass their checks on the kernel path, and
    a kernel path that leaves an unowned row non-zero is reported."""
    from benchmarks import hostile_gemms

    pairs = (("int4_g128", None), ("fp8_block128", "fp8_dynamic_group128"))
    results = hostile_gemms.run(256, 8, 64, 128, [], backend="interpret", pairs=pairs)
    assert len(results) == 12 and all(r["ok"] for r in results)
    layouts = {"extremes", "one_expert", "crowded", "indexed", "slot_order", "tile_by_expert"}
    assert {r["layout"] for r in results} == layouts
    unowned = ("crowded", "indexed", "slot_order", "tile_by_expert")
    assert all(r["unowned_rows"] > 0 for r in results if r["layout"] in unowned)
    real = hj.gemm
    poisoned = lambda *a, backend=None, **k: real(*a, backend=backend, **k) + (backend != "reference")  # noqa: E731
    monkeypatch.setattr(hj, "gemm", poisoned)
    assert not hostile_gemms.run(256, 8, 64, 128, [], backend="interpret", pairs=pairs[:1])[0]["ok"]


@TOOL
def test_hostile_routing_checks_every_call(monkeypatch):
    """The routing sanitizer step's calls (hostile ids, an expert map,
    ``num_valid_tokens`` short of T) pass their checks on the kernel path, and
    a kernel path that moves one permuted row is reported."""
    from benchmarks import hostile_routing

    results = hostile_routing.run(48, 128, backend="interpret")
    assert len(results) == 8 and all(r["ok"] for r in results), results
    real = routing.moe_permute

    def shifted(*args, backend=None, **kwargs):
        out = real(*args, backend=backend, **kwargs)
        if backend == "reference":
            return out
        return dataclasses.replace(out, permuted_hidden_states=jnp.roll(out.permuted_hidden_states, 1, axis=0))

    monkeypatch.setattr(routing, "moe_permute", shifted)
    (row,) = hostile_routing.run(48, 128, backend="interpret", ops=("permute",))
    assert row["op"] == "permute" and not row["ok"]


def test_a_users_table_from_the_environment(tmp_path, monkeypatch):
    """``$HUMMING_JAX_TUNING`` names a table file (what ``tune --out`` writes)
    used in place of the packaged one; a missing file is an error, not the
    packaged table."""
    shipped = json.loads(tuning.table_path("h200.json").read_text())
    key, entries = next(iter(shipped["entries"].items()))
    mine = dict(meta={}, entries={key: [dict(entries[0], us=[1.0], source="mine")]})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    monkeypatch.setenv(tuning.table.TABLE_ENV, str(path))
    table = tuning.load_table()
    assert list(table) == [key] and table[key][0].source == "mine"
    assert len(tuning.load_table("h200.json")) == len(shipped["entries"])  # a named packaged table as before
    monkeypatch.setenv(tuning.table.TABLE_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(FileNotFoundError, match="HUMMING_JAX_TUNING"):
        tuning.load_table()


@TOOL
def test_ab_tilings_writes_each_timing(tiny, compiled_once, tmp_path, capsys, monkeypatch):
    """``benchmarks.ab_tilings``: every tiling of every case in turn, each
    checked in its first round; a tiling the kernel refuses is a row naming
    why, not an abort."""
    from benchmarks import ab_tilings

    out = tmp_path / "ab.json"
    tilings = ["default", "block_m=16,block_n=32,block_k=32", "mosaic_fp8:"]
    argv = ["--formats", "bf16", "--problems", "tiny", "--gemms", "w13", "--tokens", "3", "--repeats", "2"]
    assert ab_tilings.main([*argv, "--layouts", "grouped", "--tilings", *tilings, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["repeat"], r["tiling"]) for r in rows] == [(rep, t) for rep in range(2) for t in tilings]
    for r in rows[:2]:
        assert r["us"] > 0 and r["error"] < 1e-2
    assert "e4m3/e5m2" in rows[2]["failed"]  # the fp8 kernel refuses bf16 inputs, with its reason
    # --humming: Humming's kernel in every round, after the round's tilings
    with monkeypatch.context() as patch:
        patch.setattr(bench, "humming_peers", lambda prep: {"humming_graph": lambda repeats: 7e-6})
        assert ab_tilings.main([*argv, "--humming", "--tilings", "default", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["repeat"], r["tiling"]) for r in rows] == [
        (rep, t) for rep in range(2) for t in ("default", "humming_graph")
    ]
    assert rows[1]["us"] == pytest.approx(7.0)
    # --seeds: each routing its own case, with its largest expert's rows
    assert ab_tilings.main([*argv[:-1], "1", "--seeds", "0", "1", "--tilings", "default", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["seed"] for r in rows] == [0, 1] and all(1 <= r["expert_rows_max"] <= 3 * 2 for r in rows)
    with pytest.raises(ValueError, match="kernel must be one of"):
        ab_tilings.main([*argv, "--tilings", "nope:block_m=16"])
    # A run stopped in its second case (a time limit) has written the first one's rows.
    real_prepare, prepared_cases = bench.prepare, []

    def prepare_then_stop(case, seed=0):
        if prepared_cases:
            raise KeyboardInterrupt
        prepared_cases.append(case)
        return real_prepare(case, seed)

    stopped = tmp_path / "stopped.json"
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(bench, "prepare", prepare_then_stop)
        ab_tilings.main([*argv[:-3], "3", "4", "--repeats", "1", "--tilings", "default", "--out", str(stopped)])
    assert [r["tokens"] for r in json.loads(stopped.read_text())["rows"]] == [3]
    # MXFP4's scales as to_kernel_order stores them ([E, K/32, N]) and as [E, N, K/32], interleaved
    orders = ["--scale-orders", "kernel", "n_major", "--repeats", "1", "--layouts", "grouped"]
    assert ab_tilings.main([*argv[:1], "mxfp4", *argv[2:-2], *orders, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["fmt"], r["scale_order"]) for r in rows] == [("mxfp4", "kernel"), ("mxfp4", "n_major")]
    assert all(r["us"] > 0 and r["error"] < 1e-2 for r in rows)
    prepared = {
        order: bench.prepare(bench.Case("tiny", "w13", "grouped", 3, "int4_g32", scale_order=order))
        for order in ("kernel", "k_major")
    }
    assert not prepared["kernel"].weights[0].k_major_scales and prepared["k_major"].weights[0].k_major_scales


def test_humming_peer_routing_and_the_anchor_fallback(tiny, monkeypatch):
    """Humming's grouped rows and its moe_align_block_size as its own
    benchmark writes them (NumPy against a slot-by-slot model); without its
    package the bench reads the anchor, with it the live time wins and the
    anchor's stays beside it."""
    from humming_jax import humming_peer

    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(6)[:2] for _ in range(7)]).astype(np.int32)
    counts, order, starts = humming_peer.routing_arrays(ids, 6)
    flat = ids.reshape(-1)
    assert list(flat[order]) == sorted(flat) and starts[-1] == flat.size
    sorted_ids, expert_ids, padded = humming_peer.align(ids, 6, 4)
    assert padded[0] == sorted_ids.size == 4 * expert_ids.size
    for b, expert in enumerate(expert_ids):
        block = sorted_ids[4 * b : 4 * b + 4]
        real = block[block < flat.size]
        assert np.all(flat[real] == expert) and len(real) > 0
    assert sorted(sorted_ids[sorted_ids < flat.size]) == list(range(flat.size))

    monkeypatch.setattr(bench, "KERNEL_BACKEND", "reference")
    anchor = {("tiny", "grouped", "w13", 3, "bf16"): 2.0}
    monkeypatch.setattr(humming_peer, "available", lambda: False)
    (row,) = bench.run_bench(["tiny"], [3], ["bf16"], layouts=["grouped"], gemms=["w13"], compare=False, anchor=anchor)
    assert row["humming_source"] == "anchor" and row["humming_us"] == 2.0 and "anchor_humming_us" not in row
    monkeypatch.setattr(humming_peer, "available", lambda: True)
    # Timed both ways the anchor was; the faster is the ratio's reference, both kept.
    fake = {humming_peer.GRAPH: lambda repeats: 5e-6, humming_peer.DO_BENCH: lambda repeats: 4e-6}
    monkeypatch.setattr(humming_peer, "humming_samplers", lambda *a: fake)
    (row,) = bench.run_bench(["tiny"], [3], ["bf16"], layouts=["grouped"], gemms=["w13"], compare=False, anchor=anchor)
    assert (row["humming_source"], row["anchor_humming_us"]) == ("live", 2.0)
    assert row["humming_us"] == pytest.approx(4.0) and row["humming_graph_us"] == pytest.approx(5.0)
    assert row["x_humming"] == pytest.approx(row["us"] / 4.0)


def test_peers_are_timed_interleaved_with_ours(tiny, compiled_once, monkeypatch):
    """torch's grouped GEMM and Humming are sampled in turn with ours, each
    round one later than the last (ours first in the first); each row carries
    every peer's median and spread."""
    from humming_jax import humming_peer

    order = []

    def recording(name, seconds):
        def sample(repeats):
            order.append(name)
            return seconds.pop(0)

        return sample

    monkeypatch.setattr(bench, "TIMING_REPEATS", 3)
    monkeypatch.setattr(bench, "sampler", lambda fn, sets, **_: recording("ours", [1e-6, 3e-6, 2e-6]))
    monkeypatch.setattr(
        bench, "torch_peers", lambda prep: {bench.TORCH_GROUPED_MM: recording("torch", [9e-6, 7e-6, 8e-6])}
    )
    monkeypatch.setattr(humming_peer, "available", lambda: True)
    monkeypatch.setattr(
        humming_peer, "humming_samplers", lambda *a: {humming_peer.GRAPH: recording("humming", [6e-6, 4e-6, 5e-6])}
    )
    monkeypatch.setattr(bench, "time_ragged_dot", lambda *a: None)
    (row,) = bench.run_bench(["tiny"], [3], ["bf16"], layouts=["grouped"], gemms=["w13"])
    assert order == ["ours", "torch", "humming", "torch", "humming", "ours", "humming", "ours", "torch"]
    assert row["us"] == pytest.approx(2.0) and row["us_spread"] == pytest.approx([1.0, 3.0])
    assert row["torch_grouped_mm_us"] == pytest.approx(8.0) and row["vs_torch"] == pytest.approx(4.0)
    assert row["peer_us_spread"][bench.TORCH_GROUPED_MM] == pytest.approx([7.0, 9.0])
    assert row["humming_us"] == pytest.approx(5.0) and row["humming_source"] == "live"


class _FakeCuda:
    """:class:`timing.TorchCuda`'s three methods over a clock that a launch
    advances by 100 µs; a captured graph replays its launches without Python."""

    def __init__(self, capturable: bool):
        self.capturable, self.clock, self.captures = capturable, 0.0, 0

    def capture(self, enqueue):
        self.captures += 1
        if not self.capturable:
            return None
        before = self.clock
        enqueue()  # recorded, not timed
        recorded, self.clock = self.clock - before, before
        return lambda: setattr(self, "clock", self.clock + recorded)

    def seconds(self, run):
        before = self.clock
        run()
        return self.clock - before


@pytest.mark.parametrize("capturable", [True, False])
def test_event_sampler_calibrates_and_rotates_the_sets(capturable):
    """A timing lasts at least ``min_seconds`` (iterations a power of two), every
    call rotates over the sets, one call's time comes back; a graph replays
    where the calls capture, else they launch eagerly (``sample.graph``)."""
    device = _FakeCuda(capturable)
    launched = []

    def launch(s):
        launched.append(s)
        device.clock += 1e-4

    sample = timing.event_sampler(launch, 3, min_seconds=0.01, device=device)
    assert sample.iterations == 64 and sample.graph == capturable  # 0.01 s / (3 · 100 µs) = 33 -> 64
    assert sample(3) == pytest.approx(1e-4)
    assert launched[:7] == [0, 1, 2, 0, 1, 2, 0] and len(launched) % 3 == 0
    eager = _FakeCuda(True)
    timing.event_sampler(lambda s: setattr(eager, "clock", eager.clock + 1e-4), 1, capture=False, device=eager)
    assert eager.captures == 0  # a call that reads back to the host is never captured


def test_layer_bench_runs_the_expert_parallel_layers_where_there_are_devices(monkeypatch):
    """On one device the expert-parallel pipelines would rerun the local layer:
    the default leaves them out; with several it takes them all."""
    from humming_jax import layer_bench

    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert layer_bench.default_pipelines() == ("grouped", "indexed", "batched", "moonep")
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    assert layer_bench.default_pipelines() == layer_bench.PIPELINES


def test_event_sampler_keeps_what_the_graph_reads_alive():
    """A graph replays its calls on the buffers they were captured with: the
    sampler keeps the launch (and what it closes over) alive as long as it
    lives. Dropping it let PyTorch hand torch's inputs to Humming's next
    allocations while torch's graph still read them (an illegal address)."""
    import gc
    import weakref

    class Buffer:
        pass

    def make_sampler():
        device, buffer = _FakeCuda(True), Buffer()

        def launch(s):
            device.clock += 1e-4 + 0 * id(buffer)

        return timing.event_sampler(launch, 2, device=device), weakref.ref(buffer)

    sample, buffer = make_sampler()
    gc.collect()
    assert buffer() is not None
    del sample
    gc.collect()
    assert buffer() is None


def test_kernel_census_walks_nested_jits_and_branches():
    """``timing.kernel_census``: each Pallas launch's name, grid and output types,
    found inside a jitted function's branches; another kernel changes it."""
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def launch(x, name):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(double, out_shape=out, interpret=True, name=name)(x)

    inner = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda y: launch(y, "twice"), lambda y: y, x) + 1)
    x = jnp.ones((8, 128), jnp.float32)
    assert timing.kernel_census(lambda x: inner(x), x) == (("twice", (), ("float32[8,128]",)),)
    assert timing.kernel_census(lambda x: launch(x, "other"), x) != timing.kernel_census(inner, x)
    assert timing.kernel_census(jax.jit(lambda x: x + 1), x) == ()


def test_kernel_census_sees_mosaic_gpu_kernels():
    """Mosaic GPU kernels (``plgpu.kernel``: the 16-bit and fp8 GEMMs) trace as
    ``mpmd_map``, not ``pallas_call``: the census lists them too (traced only;
    nothing runs), so two orders whose Mosaic GEMMs differ are told apart."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def copy(x_gmem, o_gmem):
        del x_gmem, o_gmem

    def launch(x, name, rows):
        out = jax.ShapeDtypeStruct((rows, 128), x.dtype)
        return plgpu.kernel(copy, out_type=out, grid=(2,), grid_names=("sm",), kernel_name=name)(x)

    x = jnp.ones((8, 128), jnp.float32)
    assert timing.kernel_census(jax.jit(lambda x: launch(x, "mosaic_one", 8)), x) == (
        ("mosaic_one", (2,), ("float32[8,128]",)),
    )
    assert timing.kernel_census(lambda x: launch(x, "mosaic_one", 16), x) != timing.kernel_census(
        lambda x: launch(x, "mosaic_one", 8), x
    )


def test_interleaved_takes_each_sampler_in_turn():
    order = []
    samplers = {name: (lambda repeats, name=name: order.append(name) or len(order)) for name in ("a", "b", "c")}
    got = timing.interleaved(samplers, 4)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]  # each round one later
    assert got == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}


def test_ab_tilings_variant_file(tmp_path, monkeypatch):
    """``--variant FILE``: another version of a kernel file, beside the tree's,
    tiled as ``variant:FIELDS`` and planned with its own ``supports``."""
    import pathlib

    import pallas_kernels.gemm as gemm_kernels
    from benchmarks import ab_tilings
    from humming_jax import tiles_text
    from pallas_kernels.gemm import mosaic_fp8

    monkeypatch.setattr(gemm_kernels, "KERNELS", dict(gemm_kernels.KERNELS))
    monkeypatch.setattr(gemm_kernels, "IMPLS", dict(gemm_kernels.IMPLS))
    copy = tmp_path / "older_fp8.py"
    copy.write_text(pathlib.Path(mosaic_fp8.__file__).read_text())
    ab_tilings.load_variant(str(copy))
    tiles = tiles_text.gemm_from_text("variant:block_m=64,block_n=256")
    module = gemm_kernels.KERNELS[type(tiles)]
    assert module is not mosaic_fp8 and module.__file__ == str(copy)
    assert tiles_text.gemm_to_text(tiles).startswith("variant:")
    ab_tilings.load_variant(str(copy), "v2")  # a second one by name, beside the first
    second = tiles_text.gemm_from_text("v2:block_m=64,block_n=256")
    assert gemm_kernels.KERNELS[type(second)] is not module and tiles_text.gemm_to_text(second).startswith("v2:")
    with pytest.raises(ValueError, match="kernel of the tree"):
        ab_tilings.load_variant(str(copy), "mosaic_fp8")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_ab_tilings_variant_of_a_mosaic_file_runs_mid_too(tmp_path, monkeypatch):
    """A Mosaic kernel file as ``--variant m2=FILE`` is tiled ``m2:`` (warp-
    specialized) and ``m2_mid:`` (the same body as ``mosaic_mid``, one
    warpgroup a program): both run the file's code, each lowers its own structure."""
    import pathlib

    import pallas_kernels.gemm as gemm_kernels
    from benchmarks import ab_tilings

    monkeypatch.setattr(gemm_kernels, "KERNELS", dict(gemm_kernels.KERNELS))
    monkeypatch.setattr(gemm_kernels, "IMPLS", dict(gemm_kernels.IMPLS))
    copy = tmp_path / "older_mosaic.py"
    copy.write_text(pathlib.Path(mosaic.__file__).read_text())
    ab_tilings.load_variant(str(copy), "m2")
    with pytest.raises(ValueError, match="kernel of the tree"):
        ab_tilings.load_variant(str(copy), "mosaic_mid")
    e, n, k = 2, 256, 256
    x = jax.ShapeDtypeStruct((100, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    for name, kernel in (("m2", "moe_gemm_mosaic"), ("m2_mid", "moe_gemm_mosaic_mid")):
        tiles = tiles_text.gemm_from_text(f"{name}:block_m=64,block_n=128,stages=2")
        module = gemm_kernels.KERNELS[type(tiles)]
        assert module.__file__ == str(copy) and tiles_text.gemm_to_text(tiles).startswith(f"{name}:")
        assert type(tiles).warp_specialized is (name == "m2") and isinstance(tiles, gemm_kernels.IMPLS["m2"])

        def run(x, w, o, tiles=tiles, module=module):
            return module.expert_gemm_mosaic(x, w, o, tiles, out_dtype=jnp.bfloat16)

        text = jax.jit(run).trace(x, w, offsets).lower(lowering_platforms=("cuda",)).as_text()
        assert kernel in text and (name == "m2_mid") == ("moe_gemm_mosaic_mid" in text)
    jax.clear_caches()


def test_tune_keys_quantized_input_pairs_by_their_class(tiny, compiled_once, tmp_path, monkeypatch):
    """``tune --formats WEIGHT@INPUT`` writes the pair's class (``4bit-a8``),
    which the plan looks up for calls with that input."""
    monkeypatch.setattr(search, "DECODE", (triton.Tiles(16, 32, 32),))
    monkeypatch.setattr(search, "M_RANGES", ((0, 8),))
    out = tmp_path / "table.json"
    args = ["tune", "--problem", "tiny", "--formats", "int4_g32@fp8_dynamic_token", "--layouts", "grouped"]
    assert cli.main([*args, "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["entries"]) == {"grouped_contiguous/4bit-a8"}


def test_humming_summary_and_plot(tmp_path):
    """Per format (and layout): the geometric mean and the largest of our time
    over Humming's, with the worst case; a plot of the ratio against T."""
    from humming_jax import bench_report

    def row(fmt, layout, gemm, tokens, ratio):
        return dict(fmt=fmt, problem="p", layout=layout, gemm=gemm, tokens=tokens, x_humming=ratio)

    rows = [row("a", "grouped", "w13", 1, 0.5), row("a", "indexed", "w2", 16, 2.0), row("b", "grouped", "w13", 1, None)]
    (both, grouped, indexed) = bench_report.humming_summary(rows)
    assert (both["fmt"], both["layout"], both["cases"]) == ("a", "all", 2)
    assert both["geomean"] == pytest.approx(1.0) and both["max"] == 2.0 and both["worst"] == ("p", "indexed", "w2", 16)
    assert (grouped["layout"], grouped["geomean"], indexed["max"]) == ("grouped", 0.5, 2.0)
    assert "geomean 1.00, max 2.00 (p indexed w2 16)" in bench_report.summary_lines([both])[0]
    pytest.importorskip("matplotlib")
    assert bench_report.plot_humming(rows, str(tmp_path / "x.png")) and (tmp_path / "x.png").stat().st_size > 0
    assert not bench_report.plot_humming(rows[2:], str(tmp_path / "none.png"))


def test_report_merges_runs_and_takes_the_faster_humming(tmp_path, capsys):
    """``report``: a later file's row replaces an earlier one's for the same
    case; the ratio against the faster of Humming's live and anchor times; per
    format the geomean, the largest, the count above 1.25 and the geomean by T."""
    import json

    from humming_jax import __main__ as cli
    from humming_jax import bench_report

    def row(tokens, us, live, anchor, gemm="w13"):
        x = us / live if live else None
        return dict(
            fmt="a", problem="p", layout="grouped", gemm=gemm, tokens=tokens, us=us,
            humming_us=live, anchor_humming_us=anchor, x_humming=x,
        )  # fmt: skip

    old = [row(1, 100.0, 50.0, 50.0), row(16, 30.0, 20.0, 10.0)]
    new = [row(1, 40.0, 80.0, 20.0), row(16, 30.0, None, 15.0, gemm="w2")]
    merged = bench_report.merge_rows([old, new])
    assert len(merged) == 3 and [r["us"] for r in merged if r["tokens"] == 1] == [40.0]
    assert bench_report.against_faster(new[0]) == 2.0 and bench_report.against_faster(new[1]) == 2.0
    assert bench_report.against_faster(dict(us=1.0)) is None
    (faster,) = bench_report.by_tokens(merged)
    assert (faster["cases"], faster["max"], faster["above_1_25"]) == (3, 3.0, 3)
    assert faster["by_tokens"][1] == pytest.approx(2.0) and faster["by_tokens"][16] == pytest.approx(6**0.5)
    (live,) = bench_report.by_tokens(merged, lambda r: r.get("x_humming"))
    assert live["cases"] == 2 and live["by_tokens"] == {1: 0.5, 16: 1.5}
    paths = []
    for name, rows in (("old", old), ("new", new)):
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(meta={}, rows=rows)))
    out = tmp_path / "merged.json"
    assert cli.main(["report", *paths, "--out", str(out)]) == 0
    assert "x faster of live and anchor a: 3 cases, geomean" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert len(written["rows"]) == 3 and written["meta"]["merged_from"] == paths
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a bench results file"):
        bench_report.report_main([str(tmp_path / "bad.json")], None)
    (tmp_path / "layer.json").write_text(json.dumps(dict(meta={}, rows=[dict(fmt="a", tokens=1)])))
    with pytest.raises(ValueError, match="rows lack gemm, layout, problem"):
        bench_report.report_main([str(tmp_path / "layer.json")], None)


def test_ab_tilings_variant_runs_the_default_tiles(tiny, compiled_once, tmp_path, monkeypatch):
    """``variant:default``: the tiles the case's ``default`` ran, field for
    field, on the variant file's kernel (an A/B of a kernel change at the
    table's own choice); listed before ``default`` it is a failed row."""
    import pathlib

    import pallas_kernels.gemm as gemm_kernels
    from benchmarks import ab_tilings
    from pallas_kernels.gemm import triton as tree_triton

    monkeypatch.setattr(gemm_kernels, "KERNELS", dict(gemm_kernels.KERNELS))
    monkeypatch.setattr(gemm_kernels, "IMPLS", dict(gemm_kernels.IMPLS))
    copy = tmp_path / "older_triton.py"
    copy.write_text(pathlib.Path(tree_triton.__file__).read_text())
    out = tmp_path / "ab.json"
    argv = ["--formats", "bf16", "--problems", "tiny", "--gemms", "w13", "--tokens", "3", "--repeats", "1"]
    tilings = ["variant:default", "default", "variant:default"]
    assert ab_tilings.main([*argv, "--variant", str(copy), "--tilings", *tilings, "--out", str(out)]) == 0
    first, default, variant = json.loads(out.read_text())["rows"]
    assert "needs 'default' listed before it" in first["failed"]
    assert default["tiles"].startswith("triton:") and variant["tiles"] == "variant:" + default["tiles"].split(":", 1)[1]
    assert variant["us"] > 0 and variant["error"] < 1e-2


def test_random_bf16_has_the_bit_patterns_of_real_data(monkeypatch):
    """The benchmarks' data: normal values rounded once from float32 (thousands
    of distinct bf16 patterns, as ``torch.randn`` gives the peers), not
    ``jax.random.normal`` in bf16 (128 values, which a power-limited GEMM
    runs faster on); drawn a chunk of the leading axis at a time."""
    import jax.numpy as jnp

    x = bench.random_bf16(jax.random.key(0), (64, 1024), 0.5)
    assert x.shape == (64, 1024) and x.dtype == jnp.bfloat16
    values = np.asarray(x, np.float32)
    assert len(np.unique(values)) > 2000
    assert 0.45 < values.std() < 0.55 and abs(values.mean()) < 0.02
    monkeypatch.setattr(bench, "QUANTIZE_CHUNK_BYTES", 4 * 1024 * 5)  # five rows a chunk
    chunked = bench.random_bf16(jax.random.key(0), (12, 32, 32))
    assert chunked.shape == (12, 32, 32)
    assert not np.array_equal(np.asarray(chunked[:5], np.float32), np.asarray(chunked[5:10], np.float32))


_CLASS_FORMATS = {"16bit": "bf16", "4bit": "int4_g128", "fp4": "mxfp4", "fp4-a8": "mxfp4@fp8_dynamic_group128"}


def _layers_weight(config, floats):
    """The w13 weight's abstract arrays, quantized and ordered as the layer stores it (``to_kernel_order``)."""

    def stored(w):
        weight = F.quantize_weight(w, config.weight_format)
        return hj.experts.to_kernel_order(hj.ExpertWeights(w13=weight, w2=weight), config).w13

    return jax.eval_shape(stored, floats)


def _planned(layout_name, weight, quant, m, activation=None):
    """The tiling ``plan`` runs (and the refusals before it) on abstract arrays:
    a grouped layout of ``m`` rows, or an indexed one of ``m / 8`` tokens at
    top-8 aligned to the block the layer takes (the first candidate's rows);
    with ``activation`` applied in its tiles (None if they cannot)."""
    e, n, k = weight.shape
    chosen = []
    if layout_name == "grouped_contiguous":
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        routing_arrays = (jax.ShapeDtypeStruct((e + 1,), jnp.int32),)
        make_layout = L.GroupedContiguous
    else:
        dtype = quant.dtype.value if quant.is_quantized else None
        block = tuning.indexed_block_rows(tuning.candidates("indexed", weight.format, m, e, n, k, input_dtype=dtype))
        slots = m + e * (block - 1)
        x = jax.ShapeDtypeStruct((m // 8, k), jnp.bfloat16)
        routing_arrays = tuple(
            jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((slots,), (-(-slots // block),), (1,))
        )
        make_layout = functools.partial(L.Indexed, top_k=8, block_size=block, lists_dropped=True)

    def trace(x, routing_arrays, weight):
        if quant.is_quantized:
            x = Q.quantize_input(x, quant)
        layout = make_layout(*routing_arrays)
        chosen.append(plan(as_quantized_input(x), weight, layout, valid_shape_m=m, activation=activation))
        return x

    jax.eval_shape(trace, x, routing_arrays, weight)
    return chosen[0]


def _as_run(listed, layout_name, ran):
    """An indexed layout runs a Triton entry on its block's rows (``for_block``)."""
    if layout_name == "indexed" and isinstance(listed, triton.Tiles) and ran is not None:
        return heuristic.for_block(listed, ran.block_m)
    return listed


def _entry_shapes(key: str) -> list[tuple[int, int, int]]:
    """The weight shapes an entry of ``key`` is for: its own, or for a
    format-class key the bench problems' w13 and w2 shapes."""
    shape = key.partition("@")[2]
    if shape:
        return [tuple(int(part.split("=")[1]) for part in shape.split(","))]
    return [
        bench.Case(problem, gemm, "grouped", 1, "bf16").shapes()[:3]
        for problem in bench.PROBLEMS
        for gemm in ("w13", "w2")
    ]


def test_shipped_entries_run_on_the_layers_weights(monkeypatch):
    """Each entry of the shipped table is the tiling ``plan`` runs at the top
    of its M range (grouped, and indexed on the block the layer aligns to) on
    weights stored as the layer stores them (``to_kernel_order``: planar
    codes, e2m1 half-bits, e8m0 scales K-major) — under a weight-shape key on
    that shape, under a format-class key on each bench problem's shapes the
    class entry serves there (no entry of the shape's own key at that M): no
    entry its kernel refuses, which would silently run the next candidate.
    Traced on abstract arrays (no weight is made), the Mosaic kernels told
    they are on the H200 the table is for."""
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    table = tuning.load_table("h200.json")
    checked = 0
    for key, entries in table.items():
        layout_name, rest = key.split("/", 1)
        fmt_class = rest.partition("@")[0]
        if fmt_class not in _CLASS_FORMATS:
            continue
        weight_format, quant = bench.split_format(_CLASS_FORMATS[fmt_class])
        for e, n, k in _entry_shapes(key):
            if k % max(weight_format.group_size, 1):
                continue  # a format the problem cannot take (gpt-oss's K with 128-column groups)
            config = hj.ExpertsConfig(e, k, n, 8, weight_format=weight_format, input_quant=quant)
            weight = _layers_weight(config, jax.ShapeDtypeStruct((e, n, k), jnp.float32))
            own = table.get(tuning.table_key(layout_name, fmt_class, (e, n, k)), ())
            for entry in entries:
                m = entry.max_shape_m if entry.max_shape_m < 2**30 else 2 * entry.min_shape_m
                if "@" not in key and any(o.min_shape_m < m <= o.max_shape_m for o in own):
                    continue  # the shape's own entry serves this M
                tiles, reasons = _planned(layout_name, weight, quant, m)
                where = (key, (e, n, k), entry.min_shape_m, entry.max_shape_m, reasons)
                # gpt-oss-120b (no entries of its own yet, issue 31) included: its N (5760 / 2880)
                # in a partial last column tile, its K (2880) in a partial last step.
                assert tiles == _as_run(entry.tiles, layout_name, tiles), where
                checked += 1
    assert checked > 100


def test_heuristic_prefill_tiles_run_on_a_shape_without_entries(monkeypatch):
    """On a problem the table has no entries for (``qwen3-235b-a22b``), the
    heuristic's first 4-bit prefill tiling is what ``plan`` runs on the
    layer's stored weights, grouped: ``mosaic_mid`` at 32 and 64 rows an
    expert, the decoding Mosaic tile (144 rows) from 128 (not a refusal that silently
    runs the Triton tile); indexed, that tile on the block it sized. Abstract
    arrays, the Mosaic kernels told they are on a Hopper GPU."""
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    problem = "qwen3-235b-a22b"
    expected = {512: heuristic.MID_48, 1024: heuristic.MID_64, 2048: heuristic.decode_tiles(128, 128)}
    for fmt_name in ("int4_g128", "mxfp4"):
        weight_format, quant = bench.split_format(fmt_name)
        for gemm_name in ("w13", "w2"):
            e, n, k, top_k = bench.Case(problem, gemm_name, "grouped", 1, fmt_name).shapes()
            assert not tuning.table_entries("grouped_contiguous", weight_format, 512 * top_k, e, n, k)
            config = hj.ExpertsConfig(e, k, n, top_k, weight_format=weight_format, input_quant=quant)
            weight = _layers_weight(config, jax.ShapeDtypeStruct((e, n, k), jnp.float32))
            act = None
            if gemm_name == "w13":  # the layer's activation, applied in w13's tiles
                act = dataclasses.replace(config.activation, gate_up_block=weight.gate_up_block)
                assert weight.gate_up_block  # gate and up rows interleaved, as the layer stores them
            for tokens, tiles in expected.items():
                ran, reasons = _planned("grouped_contiguous", weight, quant, tokens * top_k, act)
                assert ran == tiles, (fmt_name, gemm_name, tokens, reasons)
    # Indexed at 256 rows an expert: the decoding tile on the block it sized (144 rows), W4A8
    # with its input multiplied out — a kernel takes the layout aligned to its rows.
    for fmt_name in ("int4_g128", "mxfp4", "mxfp4@fp8_dynamic_group128"):
        weight_format, quant = bench.split_format(fmt_name)
        e, n, k, top_k = bench.Case(problem, "w13", "indexed", 4096, fmt_name).shapes()
        config = hj.ExpertsConfig(e, k, n, top_k, weight_format=weight_format, input_quant=quant)
        weight = _layers_weight(config, jax.ShapeDtypeStruct((e, n, k), jnp.float32))
        ran, reasons = _planned("indexed", weight, quant, 4096 * top_k)
        wanted = dataclasses.replace(heuristic.decode_tiles(256, e), dequantize_input=quant.is_quantized)
        assert ran == wanted and ran.block_m == 144, (fmt_name, reasons)


def test_indexed_blocks_are_taken_by_the_tiling_that_sized_them():
    """An indexed layout is aligned to the rows of the first tiling listed for
    it (``indexed_block_rows``); listed again with that block, the same tiling
    comes first — a decoding tile sized to the experts' rows (144, 160: not a
    power of two, which the Triton tile cannot take) included — on every bench
    problem, format class and batch size."""
    formats = ("bf16", "int4_g128", "mxfp4", "mxfp4@fp8_dynamic_group128", "fp8_block128@fp8_dynamic_group128")
    for problem in bench.PROBLEMS:
        for fmt_name in formats:
            weight_format, quant = bench.split_format(fmt_name)
            dtype = quant.dtype.value if quant.is_quantized else None
            for gemm_name in ("w13", "w2"):
                for tokens in (1, 16, 128, 512, 1024, 2048, 4096, 16384):
                    e, n, k, top_k = bench.Case(problem, gemm_name, "indexed", tokens, fmt_name).shapes()
                    args = ("indexed", weight_format, tokens * top_k, e, n, k)
                    listed = tuning.candidates(*args, half_bits=True, input_dtype=dtype)
                    block = tuning.indexed_block_rows(listed)
                    again = tuning.candidates(*args, block_size=block, half_bits=True, input_dtype=dtype)
                    assert again[0] == listed[0] and again[0].block_m == block, (problem, fmt_name, gemm_name, tokens)
    assert heuristic.decode_block_tile(144) == heuristic.decode_tiles(128, 128)
    assert heuristic.decode_block_tile(64) is None and heuristic.decode_block_tile(148) is None
    sized = {heuristic.decode_tiles(rows, e).block_m for rows in range(128, 20000, 7) for e in (1, 8, 64, 256)}
    assert sized <= set(range(heuristic.DECODE_ROWS_MIN, heuristic.DECODE_ROWS_MAX + 1, 8))
    assert heuristic.DECODE_ROWS_MIN in sized


@TOOL
def test_k_scan_fits_the_per_tile_overhead(tiny, compiled_once, tmp_path, monkeypatch, capsys):
    """The scan times the problem's w2 at each K (the table's tiling, weights
    as the bench makes them) and leaves the problem set as it found it; the
    fit recovers a line's intercept and slope."""
    from benchmarks import k_scan

    out = tmp_path / "k_scan.json"
    problems = dict(bench.PROBLEMS)
    args = ["--problem", "tiny", "--fmt", "bf16", "--tokens", "3", "--ks", "32", "64", "--out", str(out)]
    assert k_scan.main(args) == 0
    (result,) = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in result["rows"]] == [32, 64] and all(r["us"] > 0 and r["tiles"] for r in result["rows"])
    assert bench.PROBLEMS == problems
    assert "intercept" in capsys.readouterr().out
    fit = k_scan.fit_line([768, 1536, 3072], [5.0 + 0.01 * k for k in (768, 1536, 3072)])
    assert fit["intercept_us"] == pytest.approx(5.0) and fit["us_per_k"] == pytest.approx(0.01)
    assert fit["share_at_first_k"] == pytest.approx(5.0 / 12.68)
    with pytest.raises(SystemExit):
        k_scan.main(["--problem", "tiny", "--ks", "32"])
    # a kernel file beside the tree's, scanned on its own tiles (as ab_tilings' --variant)
    import pathlib

    import pallas_kernels.gemm as gemm_kernels

    monkeypatch.setattr(gemm_kernels, "KERNELS", dict(gemm_kernels.KERNELS))
    monkeypatch.setattr(gemm_kernels, "IMPLS", dict(gemm_kernels.IMPLS))
    copy = tmp_path / "other_triton.py"
    copy.write_text(pathlib.Path(triton.__file__).read_text())
    variant = ["--variant", f"t9={copy}", "--config", "t9:block_m=16,block_n=32,block_k=32"]
    assert k_scan.main([*args, *variant]) == 0
    (result,) = json.loads(out.read_text())["rows"]
    assert all(r["tiles"].startswith("t9:") for r in result["rows"])


def test_inspect_gemm_times_humming_on_the_same_case(tiny, monkeypatch, capsys):
    """``inspect_gemm --humming``: Humming's kernel on the case just inspected
    (its routing and shapes), each way the bench times it; a clear exit
    without its package or without a kernel for the format."""
    from benchmarks import inspect_gemm
    from humming_jax import humming_peer

    prep = bench.prepare(bench.Case("tiny", "w13", "grouped", 3, "bf16"))
    seen = []

    def samplers(fmt, layout, gemm, ids, shapes):
        seen.append((fmt, layout, gemm, ids.shape, shapes))
        return {humming_peer.GRAPH: lambda repeats: 5e-6, humming_peer.DO_BENCH: lambda repeats: 6e-6}

    monkeypatch.setattr(humming_peer, "available", lambda: True)
    monkeypatch.setattr(humming_peer, "humming_samplers", samplers)
    assert inspect_gemm._time_humming(prep) == 0
    assert seen == [("bf16", "grouped", "w13", (3, 2), (4, 64, 64, 2))]
    out = capsys.readouterr().out
    assert "humming_graph: 5.0 us" in out and "humming_do_bench: 6.0 us" in out
    monkeypatch.setattr(humming_peer, "humming_samplers", lambda *a: {})
    assert inspect_gemm._time_humming(prep) == 2 and "no kernel" in capsys.readouterr().err
    monkeypatch.setattr(humming_peer, "available", lambda: False)
    assert inspect_gemm._time_humming(prep) == 2 and "missing" in capsys.readouterr().err


@TOOL
def test_ab_gate_up_times_both_orders(tiny, compiled_once, tmp_path, capsys, monkeypatch):
    """``benchmarks.ab_gate_up``: a layer on w13 interleaved (the activation in
    its tiles) and in halves, timed in turn; their outputs within a bf16
    rounding; a malformed case names the form."""
    from benchmarks import ab_gate_up

    monkeypatch.setitem(bench.PROBLEMS, "tiny_gated", (4, 128, 64, 2))  # N = 128: one gate/up pair of 64
    out = tmp_path / "ab_gate_up.json"
    cases = ["tiny_gated:indexed:3:bf16", "tiny_gated:grouped:5:bf16", "tiny_gated:moonep:4:bf16"]
    assert ab_gate_up.main(["--cases", *cases, "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = [(r["pipeline"], r["tokens"], r["gate_up_block"]) for r in rows]
    # MoonEP: the module's one w13 against its own form
    assert got == [("indexed", 3, 64), ("grouped", 5, 64), ("moonep", 4, 64)]
    for r in rows:
        assert r["rel_diff"] < 1e-2 and len(r["blocks"]) == len(r["halves"]) == 3
    with pytest.raises(ValueError, match="PROBLEM:grouped"):
        ab_gate_up.main(["--cases", "tiny_gated:ep:3:bf16"])
    # --stages: each order's stages timed alone, w13 and the activation pass apart
    staged = tmp_path / "ab_gate_up_stages.json"
    args = ["--cases", "tiny_gated:grouped:5:bf16", "--repeats", "2", "--stages", "--out", str(staged)]
    assert ab_gate_up.main(args) == 0
    (row,) = json.loads(staged.read_text())["rows"]
    for order in ("blocks", "halves"):
        times = row[f"{order}_stages"]
        assert {"w13", "w2", "combine"} <= set(times) and all(len(t) == 3 and t[0] > 0 for t in times.values())
    with pytest.raises(ValueError, match="--stages: MoonEP"):
        ab_gate_up.main(["--cases", "tiny_gated:moonep:4:bf16", "--stages"])
    assert all("same_kernels" not in r for r in rows)
    # A third order that runs the first's program (as a patch a jitted pipeline's cached trace never
    # saw would) is named: the row says so, and stderr.
    made = ab_gate_up.orders
    monkeypatch.setattr(ab_gate_up, "ORDERS", ("blocks", "again", "halves"))
    monkeypatch.setattr(
        ab_gate_up, "orders", lambda case, seed=0: {**made(case, seed), "again": made(case, seed)["blocks"]}
    )
    layer = ab_gate_up.layer_fn
    monkeypatch.setattr(
        ab_gate_up, "layer_fn", lambda case, order: layer(case, "blocks" if order == "again" else order)
    )
    capsys.readouterr()
    row = ab_gate_up.time_case(ab_gate_up.parse_case("tiny_gated:grouped:5:bf16"), 1)
    assert row["same_kernels"] == [["blocks", "again"]]
    assert "orders 'blocks' and 'again' launch the same" in capsys.readouterr().err


@TOOL
def test_call_forms_bench_times_every_form(tmp_path):
    """The call-form benchmark: a row per form, issued within waited, the JSON
    written; every form's step gives the model's result."""
    import json

    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_call_forms

    out = tmp_path / "forms.json"
    assert (
        bench_call_forms.main(["--blocks", "1", "--body", "light", "--calls", "3", "--rounds", "1", "--out", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["form"] for r in rows] == list(bench_call_forms.forms(bench_call_forms.Model(1, True), None))
    assert all(0 < r["issued_us"] <= r["waited_us"] and r["variables"] == 5 for r in rows)
    model = bench_call_forms.Model(1, light=False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.bfloat16)
    want = np.asarray(model(x), np.float32)
    # The forms test_nn's decode-loop test does not already check on every expert module.
    for name, step in bench_call_forms.forms(model, x).items():
        if name in ("nnx.jit graph", "nnx.jit_partial"):
            np.testing.assert_allclose(np.asarray(step(), np.float32), want, rtol=1e-2, atol=1e-2, err_msg=name)
