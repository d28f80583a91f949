"""`make demo` (scripts/demo.py) shortened to 30 iterations, validation every 10: the standard
library corpus (built under data/ on first use, as `make demo` does), two torchrun jobs of two
processes each (AdamW, then Muon with the layer-wise distributed optimizer), one PNG, one summary.

Whether Muon beats AdamW is test_muon_beats_adamw.py's question; here only the plumbing is
checked: the jobs run, the picture holds both optimizers' curves and the summary is complete and
finite, with losses below the uniform guess over the 256 byte values.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from megatron_eopt.training.logging.training_log import PALETTE, PLOT_SIZE

ROOT = pathlib.Path(__file__).resolve().parents[2]
ITERATIONS = 30
EVAL_INTERVAL = 10
CURVE_PIXELS = 300  # a curve across the plot covers thousands; the legend swatch alone ~70


# `make test-slow` (~60 s: four torchrun ranks import megatron-core): make test trains the same corpus under
# torchrun (test_pretrain_gpt.py), draws the curves (tests/unit/training/logging/) and sets Muon against AdamW
# (test_muon_beats_adamw.py); `make demo` itself is run before each stop (docs/testing.md).
@pytest.mark.slow
def test_demo_writes_plot_and_summary(tmp_path: pathlib.Path) -> None:
    command = [sys.executable, "scripts/demo.py", "--train-iters", str(ITERATIONS), "--eval-interval",
               str(EVAL_INTERVAL), "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"corpus", "train_iters", "processes", "smoothing_window", "eval_interval", "eval_iters",
                            "adamw", "muon", "muon_iterations_to_adamw_final_validation_loss"}
    assert (summary["train_iters"], summary["processes"], summary["eval_interval"]) == (ITERATIONS, 2, EVAL_INTERVAL)
    assert "standard library" in summary["corpus"]
    for key in ("adamw", "muon"):
        assert set(summary[key]) == {"lr", "final_loss", "final_validation_loss", "ms_per_iteration"}
        assert all(math.isfinite(value) and value > 0 for value in summary[key].values()), summary[key]
        for loss in ("final_loss", "final_validation_loss"):
            assert summary[key][loss] < math.log(256), summary[key]  # better than a uniform guess of bytes
    reached = summary["muon_iterations_to_adamw_final_validation_loss"]
    assert reached is None or EVAL_INTERVAL <= reached <= ITERATIONS
    assert (tmp_path / "summary.txt").read_text() in result.stdout

    from PIL import Image

    with Image.open(tmp_path / "loss.png") as image:
        assert image.format == "PNG" and image.size == PLOT_SIZE
        colors = {color[:3]: count for count, color in image.convert("RGBA").getcolors(1 << 20)}
    for color in PALETTE[:2]:  # AdamW's, Muon's
        assert colors.get(color, 0) > CURVE_PIXELS, (color, sorted(colors.items(), key=lambda kv: -kv[1])[:6])
