"""Writes and executes the example notebooks (run from the repository root:
``python notebooks/build_notebooks.py``). The committed notebooks carry the
outputs of that run; the test suite re-executes them."""

from __future__ import annotations

import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))

QUICKSTART = [
    (
        "markdown",
        """# humming_jax quickstart

Build each expert module on a small Qwen3-like layer, run it on the default
backend (the Pallas kernels on a GPU, the XLA reference elsewhere) and compare
it with the pure-`jnp` reference.""",
    ),
    (
        "code",
        """import os
if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # simulated devices for the expert-parallel cell
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import humming_jax as hj
from humming_jax import nn

print("JAX", jax.__version__, "on", jax.default_backend(), "- default backend:", hj.default_backend())
config = hj.ExpertsConfig(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2,
                          weight_format="int4_g128", activation="silu")
x = jax.random.normal(jax.random.key(0), (12, 128), jnp.bfloat16)
logits = jax.random.normal(jax.random.key(1), (12, 8))
topk_weights, topk_ids = nn.route(logits, top_k=2)

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)""",
    ),
    (
        "code",
        """grouped = nn.HummingGroupedExperts(config, rngs=nnx.Rngs(0))
indexed = nn.HummingIndexedExperts.from_quantized(config, grouped.weights, block_size=16)
out_grouped = grouped(x, topk_weights, topk_ids)
out_indexed = indexed(x, topk_weights, topk_ids)
reference = hj.humming_grouped_experts(x, grouped.weights, topk_weights, topk_ids, config, backend="reference")
print("grouped vs reference:", rel(out_grouped, reference))
print("indexed vs reference:", rel(out_indexed, reference))
print("workspace plan (grouped, 12 tokens):")
for name, buffer in grouped.workspace(12).buffers.items():
    print(f"  {name:24s} {buffer.shape} {buffer.dtype}")
print("peak bytes:", grouped.workspace(12).peak_bytes)""",
    ),
    (
        "code",
        """batched = nn.BatchedHummingGroupedExperts(config, rngs=nnx.Rngs(0), max_num_tokens=4)
xb = jax.random.normal(jax.random.key(2), (8, 4, 128), jnp.bfloat16)
counts = jnp.asarray([1, 4, 0, 2, 3, 0, 4, 1], jnp.int32)
out_batched = batched(xb, counts)
ref_batched = hj.batched_humming_grouped_experts(xb, counts, batched.weights, config, backend="reference")
print("batched vs reference:", rel(out_batched, ref_batched))

moon = nn.MoonEPExperts(num_experts=4, hidden_size=128, intermediate_size=64, num_redundant=2, rngs=nnx.Rngs(3))
rows = jax.random.normal(jax.random.key(4), (10, 128), jnp.bfloat16)
cu_seqlens = jnp.asarray([3, 3, 6, 8, 8, 8], jnp.int32)   # empty segments, unused redundant rows
route_weights = jax.random.uniform(jax.random.key(5), (10,))
out_moon = moon(rows, cu_seqlens, route_weights)
# The module holds MoonEP's gate and up weights as one w13 (hj.moonep_w13), the activation in its GEMM's tiles.
ref_moon = hj.moonep_interleaved_experts(rows, moon.w13.get_value(), moon.w_down.get_value(),
                                         cu_seqlens, route_weights, backend="reference")
print("moonep vs reference:", rel(out_moon[:8], ref_moon[:8]), "| rows past cu_seqlens[-1] zero:",
      bool(jnp.all(out_moon[8:] == 0)))""",
    ),
    (
        "code",
        """block = nn.MoEBlock(grouped, rngs=nnx.Rngs(6), shared_intermediate_size=64)
step = nn.jit_frozen(block)  # a decode step: the weights passed to jit as one flat list (README)
h = jax.random.normal(jax.random.key(7), (2, 6, 128), jnp.bfloat16)
print("MoEBlock output:", step(h).shape, step(h).dtype, "| vs the eager block:", rel(step(h), block(h)))""",
    ),
    (
        "markdown",
        """Expert parallelism over 4 (simulated) devices: each holds 2 of the 8
experts; with `redundant_experts=2` each also takes copies of the most
loaded experts every step, so a skewed routing (expert 5 in most slots)
spreads evenly. Same output either way.""",
    ),
    (
        "code",
        """import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from humming_jax import parallel

ranks = 4
mesh = jax.make_mesh((ranks,), ("expert",), devices=jax.devices()[:ranks])
skewed = jnp.asarray(np.where(np.arange(12)[:, None] < 9, np.asarray([[5, 1]]), np.asarray(topk_ids)), jnp.int32)
want = grouped(x, topk_weights, skewed)
plain = nn.ExpertParallelExperts.from_quantized(config, grouped.weights, mesh=mesh)
balanced = nn.ExpertParallelExperts.from_quantized(config, grouped.weights, mesh=mesh, redundant_experts=2)
print("EP vs grouped:", rel(plain(x, topk_weights, skewed), want),
      "| balanced vs grouped:", rel(balanced(x, topk_weights, skewed), want))
counts = np.bincount(np.asarray(skewed).ravel(), minlength=8)
before = parallel.rank_loads(counts, ranks)
after = parallel.rank_loads(counts, ranks, *parallel.balance_plan(jnp.asarray(counts), ranks, 2))
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.bar(np.arange(ranks) - 0.2, before, 0.4, label="no copies")
ax.bar(np.arange(ranks) + 0.2, after, 0.4, label="2 copies a rank")
ax.axhline(counts.sum() / ranks, color="k", ls="--", lw=1, label="average")
ax.set(xlabel="rank", ylabel="slots served", xticks=range(ranks))
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig("ep_loads.png", dpi=90)
plt.close(fig)
display(Image("ep_loads.png"))
print("slots per rank:", np.asarray(before).tolist(), "->", np.asarray(after).tolist())""",
    ),
]

FORMATS = [
    (
        "markdown",
        """# Weight formats: error on the same weights

Every preset quantizes the same normal weights; the plot shows the relative
error of the dequantized weight and of a grouped GEMM output against the
float computation.""",
    ),
    (
        "code",
        """import jax, jax.numpy as jnp, numpy as np
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
import humming_jax as hj
from humming_jax import formats as F

w = jax.random.normal(jax.random.key(0), (4, 128, 256), jnp.float32) * 0.05
x = jax.random.normal(jax.random.key(1), (32, 256), jnp.bfloat16)
layout = hj.GroupedContiguous(jnp.asarray([0, 8, 16, 24, 32], jnp.int32))
exact = hj.gemm(x, F.quantize_weight(w, "bf16"), layout, out_dtype=jnp.float32, backend="reference")
exact = np.asarray(x, np.float64).reshape(4, 8, 256) @ np.swapaxes(np.asarray(w, np.float64), 1, 2)
exact = exact.reshape(32, 128)
rows = []
for name, fmt in F.PRESETS.items():
    q = F.quantize_weight(w, fmt)
    weight_err = float(jnp.linalg.norm(F.dequantize_weight(q) - w) / jnp.linalg.norm(w))
    out = np.asarray(hj.gemm(x, q, layout, out_dtype=jnp.float32), np.float64)
    rows.append((name, weight_err, np.linalg.norm(out - exact) / np.linalg.norm(exact)))
for name, we, oe in rows:
    print(f"{name:16s} weight {we:.2e}   gemm output {oe:.2e}")""",
    ),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(9, 3.5))
names = [r[0] for r in rows]
pos = np.arange(len(rows))
ax.bar(pos - 0.2, [r[1] for r in rows], 0.4, label="weight")
ax.bar(pos + 0.2, [r[2] for r in rows], 0.4, label="GEMM output")
ax.set_yscale("log"); ax.set_xticks(pos, names, rotation=60, ha="right"); ax.set_ylabel("relative error")
ax.legend(); fig.tight_layout(); fig.savefig("formats.png", dpi=80)
display(Image("formats.png"))""",
    ),
]

PERFORMANCE = [
    (
        "markdown",
        """# Measured performance against the roofline

Reads the benchmark JSON files in `benchmarks/results/` (measured on an
H200; every kernel version and session is kept there, `benchmarks/NOTES.md`
tells their story) and shows the latest measurement of each case: achieved
bandwidth against the measured copy bandwidth (4.3 TB/s) for the routing and
`process_input` kernels, and the expert GEMMs against their roofline and
against `torch._grouped_mm` (bf16) timed in the same run.""",
    ),
    (
        "code",
        """import json, glob, os
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

root = os.path.join(os.path.dirname(os.path.abspath("__file__")), "..", "benchmarks", "results")
files = sorted(glob.glob(os.path.join(root, "*.json")))
print([os.path.basename(f) for f in files])
data = {os.path.basename(f): json.load(open(f)) for f in files}


def latest(rows, key, version):
    \"\"\"The row of each ``key(row)`` with the highest ``version(row)`` (later rows win ties).\"\"\"
    best = {}
    for r in rows:
        k = key(r)
        if k not in best or version(r) >= version(best[k]):
            best[k] = r
    return best""",
    ),
    (
        "code",
        """fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
routing = [r for r in data.get("routing_h200.json", {"rows": []})["rows"]
           # the kernel's rows with default tiles (the first session's rows, parsed from a table, name no backend)
           if r.get("backend", "pallas") == "pallas" and r.get("row_tiles") in (None, "4x256x4")]
for op in ("unpermute", "fused_mul_sum", "permute"):
    rows = latest([r for r in routing if r["op"] == op and r.get("H") == 7168 and r["E"] == 128],
                  lambda r: r["T"], lambda r: r.get("session", 0))
    pts = sorted((t, 100 * r["copy_fraction"]) for t, r in rows.items())
    if pts:
        axes[0].plot(*zip(*pts), marker="o", label=op)
axes[0].set_xscale("log"); axes[0].set_xlabel("tokens T (E=128, k=8, H=7168)"); axes[0].set_ylabel("% of copy bandwidth")
axes[0].axhline(70, color="gray", ls="--", lw=1); axes[0].legend(); axes[0].set_title("routing kernels")
proc = [r for r in data.get("process_input_h200.json", {"rows": []})["rows"]
        if r["backend"] == "pallas" and r.get("tiles") in (None, "default") and r["K"] == 2048]
for case in sorted({r["case"] for r in proc}):
    rows = latest([r for r in proc if r["case"] == case], lambda r: r["T"], lambda r: r.get("kernel_version", ""))
    pts = sorted((t, 100 * r["copy_fraction"]) for t, r in rows.items())
    if pts:
        axes[1].plot(*zip(*pts), marker="o", label=case)
axes[1].set_xscale("log"); axes[1].set_xlabel("tokens T (k=8, K=2048)"); axes[1].axhline(70, color="gray", ls="--", lw=1)
axes[1].legend(fontsize=7); axes[1].set_title("process_input")
fig.tight_layout(); fig.savefig("performance.png", dpi=80)
display(Image("performance.png"))""",
    ),
    (
        "code",
        """gemm = data.get("gemm_h200.json", {"rows": []})["rows"]
torch_us = {(r["problem"], r["gemm"], r["tokens"], r.get("kernel_version")): r["torch_grouped_mm_us"]
            for r in gemm if r.get("torch_grouped_mm_us")}
rows = latest([r for r in gemm if r["layout"] == "grouped"],
              lambda r: (r["problem"], r["gemm"], r["tokens"], r["fmt"]),
              lambda r: (int(r.get("kernel_version", "v0")[1:]), r.get("session", 0)))  # v10 after v9
print(f"{'problem':<15}{'gemm':<5}{'T':>6}{'format':>11}{'version':>8}{'us':>9}{'% roofline':>11}{'x torch bf16':>13}")
for (problem, g, t, fmt), r in sorted(rows.items()):
    ref = torch_us.get((problem, g, t, r.get("kernel_version")))
    ratio = f"{ref / r['us']:.2f}" if ref else ""
    print(f"{problem:<15}{g:<5}{t:>6}{fmt:>11}{r.get('kernel_version', ''):>8}{r['us']:>9.1f}"
          f"{100 * r['roofline_fraction']:>10.0f}%{ratio:>13}")""",
    ),
]

CHECKPOINTS = [
    (
        "markdown",
        """# Loading a MoE layer from a checkpoint

A tiny Qwen3-MoE-shaped checkpoint written here in Hugging Face's layout (a
`config.json`, the tensors in two safetensors shards and their index), then one
call: `MoEBlock.from_checkpoint(folder, layer)` reads the config, the layer's
experts (memory-mapped: only that layer's bytes), its router (PyTorch's
`[E, H]` weight transposed to the NNX kernel) and builds the block.""",
    ),
    (
        "code",
        """import json, os, tempfile
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from safetensors.numpy import save_file
import humming_jax as hj

folder = tempfile.mkdtemp()
E, H, I, K, LAYERS = 8, 128, 64, 2, 2
config = dict(model_type="qwen3_moe", hidden_size=H, num_experts=E, moe_intermediate_size=I,
              num_experts_per_tok=K, norm_topk_prob=True)
json.dump(config, open(os.path.join(folder, "config.json"), "w"))
rng = np.random.default_rng(0)
bf16 = lambda *shape: (rng.normal(0, 0.05, shape)).astype(ml_dtypes.bfloat16)
shards = [{}, {}]
for layer in range(LAYERS):  # one shard a layer
    mlp = f"model.layers.{layer}.mlp"
    shards[layer][f"{mlp}.gate.weight"] = bf16(E, H)
    for e in range(E):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shards[layer][f"{mlp}.experts.{e}.{name}.weight"] = bf16(*shape)
weight_map = {}
for n, tensors in enumerate(shards):
    file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(tensors, os.path.join(folder, file))
    weight_map.update(dict.fromkeys(tensors, file))
json.dump({"weight_map": weight_map}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
print(sorted(os.listdir(folder)))""",
    ),
    (
        "code",
        """block = hj.nn.MoEBlock.from_checkpoint(folder, layer=1)
cfg = block.experts.config
print(f"layer 1: {cfg.num_experts} experts, H={cfg.hidden_size}, I={cfg.intermediate_size}, top_k={cfg.top_k}, "
      f"weights {cfg.weight_format.name}; router kernel {block.router.kernel.get_value().shape}")
x = jax.random.normal(jax.random.key(0), (4, H), jnp.bfloat16)
y = block(x)
print("output", y.shape, y.dtype)

# The same layer by hand: the router is x @ gate.weight.T, the experts' weights as stored.
mlp = "model.layers.1.mlp"
ckpt = hj.checkpoints.SafetensorsCheckpoint(folder)
logits = np.asarray(x, np.float32) @ np.asarray(ckpt[f"{mlp}.gate.weight"], np.float32).T
weights, ids = hj.nn.route(jnp.asarray(logits), top_k=K)
by_hand = hj.humming_grouped_experts(x, block.experts.weights, weights, ids, block.experts.config)
print("from_checkpoint vs by hand:", float(jnp.max(jnp.abs(y.astype(jnp.float32) - by_hand.astype(jnp.float32)))))""",
    ),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_formats.ipynb": FORMATS,
    "03_performance.ipynb": PERFORMANCE,
    "04_checkpoints.ipynb": CHECKPOINTS,
}


def build(name: str, cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    return nb


def main(names: list[str]) -> int:
    """Build and execute the notebooks named (default: every one)."""
    for name, cells in NOTEBOOKS.items():
        if names and name not in names:
            continue
        nb = execute(build(name, cells))
        nbformat.write(nb, os.path.join(HERE, name))
        print("wrote", name)
    for leftover in ("formats.png", "performance.png", "ep_loads.png"):
        path = os.path.join(HERE, leftover)
        if os.path.exists(path):
            os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
