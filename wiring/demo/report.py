"""The demo's per-step table, JSON figures and PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (("step", "{:>4}"), ("mean_reward", "{:>11.3f}"), ("rollouts_per_s", "{:>14.1f}"),
           ("tokens_per_s", "{:>12.1f}"), ("refit_s", "{:>8.2f}"), ("mismatch_mean", "{:>13.2e}"),
           ("mismatch_max", "{:>12.2e}"), ("weight_versions", "{:>15}"),
           ("off_policy_tokens", "{:>17.2f}"))


def header() -> str:
    return " ".join(_head(name, fmt) for name, fmt in COLUMNS)


def _head(name: str, fmt: str) -> str:
    width = int(fmt.split(">")[1].split(".")[0].rstrip("}"))
    return f"{name:>{width}}"


def row(figures: dict[str, Any]) -> str:
    cells = []
    for name, fmt in COLUMNS:
        value = figures.get(name)
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        cells.append(fmt.format(value) if value is not None else _head("-", fmt))
    return " ".join(cells)


def write_json(figures: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "demo.json"
    json_path.write_text(json.dumps(figures, indent=2) + "\n")
    return json_path


def write_outputs(steps: Sequence[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    json_path = write_json({"meta": meta, "steps": list(steps)}, out_dir)
    png_path = out_dir / "demo.png"
    _plot(steps, png_path)
    return json_path, png_path


def _plot(steps: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(x, [s["mean_reward"] for s in steps], marker="o")
    axes[0].set_title("mean reward")
    axes[1].plot(x, [s["rollouts_per_s"] for s in steps], marker="o", label="rollouts/s")
    axes[1].plot(x, [s["tokens_per_s"] / 10 for s in steps], marker="s", label="tokens/s / 10")
    axes[1].set_title("throughput")
    axes[1].legend()
    axes[2].semilogy(x, [max(s["mismatch_mean"], 1e-12) for s in steps], marker="o", label="mean")
    axes[2].semilogy(x, [max(s["mismatch_max"], 1e-12) for s in steps], marker="s", label="max")
    axes[2].set_title("|train - inference| logprob")
    axes[2].legend()
    for axis in axes:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
