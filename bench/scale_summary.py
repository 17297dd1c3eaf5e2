"""A markdown summary of one scale run: bench_scale.py's figures against N, the ratios its
done-when names (largest N over N = 8), and the cluster model's table from the per-hop figures.

    .venv/bin/python bench/scale_summary.py --results out/scale/results.json \
        [--hops out/scale/hops.json] [--out out/scale]   > summary.md

--out: also (re)draws one PNG per figure and the model's there (a run cut short by its time
limit wrote results.json after each fleet, but no plots).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from refit_cluster_model import NS, SIZES, Hops, plot as plot_model, ratio  # noqa: E402
from refit_cluster_model import report as model_report  # noqa: E402
from refit_cluster_model import table as model_table  # noqa: E402
from scale_figures import best_throughput, measured, report, write_plots  # noqa: E402


def done_when(results: dict) -> list[str]:
    """One row per criterion: the figure at the largest N, at N = 8, the ratio, the bound."""
    rows = ["| criterion | N = 8 | largest N | ratio | bound |", "|---|---|---|---|---|"]

    def row(name: str, points: list[tuple[int, float]], bound: str, unit: str = "s") -> None:
        values = dict(points)
        if 8 not in values or len(values) < 2:
            rows.append(f"| {name} | - | - | not measured | {bound} |")
            return
        top = max(values)
        rows.append(f"| {name} | {values[8]:.3f} {unit} | {values[top]:.3f} {unit} (N = {top}) "
                    f"| {values[top] / values[8]:.2f}x | {bound} |")

    row("fleet start (workers forked from the template)", measured(results, "rr", "start_s"), "<= 2x")
    row("fleet start (workers exec'd)", measured(results, "exec", "start_s"), "<= 2x")
    refits = measured(results, "rr", "refit")
    row("refit fixed part (prepare + 3 KiB update + flush)", [(n, r["fixed_s"]) for n, r in refits],
        "<= 1.5x")
    row("refit fixed part, the driver calling every worker",
        [(n, r.get("direct", r)["fixed_s"]) for n, r in refits], "<= 1.5x")
    for mib in (refits[0][1]["sizes"] if refits else {}):
        row(f"refit {mib} MiB data part / its floor",
            [(n, r["sizes"][mib]["data_over_floor"]) for n, r in refits], "<= 1.5 at every N", "x")
    row("best rollouts/s (round-robin)", [(n, best_throughput(rows_)["rollouts_per_s"])
                                          for n, rows_ in measured(results, "rr", "throughput")
                                          if best_throughput(rows_)], ">= 10,000/s", "/s")
    for n, churn in measured(results, "rr", "churn"):
        rows.append(f"| churn at N = {n}: lost / duplicated / every replacement served | | "
                    f"{churn['lost']} / {churn['duplicated']} / "
                    f"{all(churn['replacements_served'].values())} | | 0 / 0 / True |")
    memory = measured(results, "rr", "memory")
    for n, m in memory:
        rows.append(f"| worker RSS / USS at N = {n} (median, MiB) | | "
                    f"{m['workers']['rss_mib']['median']:.0f} / {m['workers']['uss_mib']['median']:.0f}"
                    " | | <= 150 |")
    return rows


def summary(results: dict, hops: Hops | None) -> str:
    lines = ["# Scale run", "",
             f"{results.get('cpus')} CPUs; memory copy {results.get('copy_bandwidth_gb_s', 0):.1f}"
             f" GB/s; args: `{json.dumps(results.get('args', {}))}`", "", "## Against the bounds",
             "", *done_when(results), "", "## Every figure", "", "```", report(results), "```"]
    if hops is not None:
        predicted = model_table(hops, calls=1)
        lines += ["", "## Cluster model (bench/refit_cluster_model.py), per-hop figures of this "
                  "machine", "", "3 control fan-outs a refit (as the bench's fixed part):", "",
                  model_report(hops, calls=3), "", "1 control fan-out a refit (update_weights):",
                  "", model_report(hops, calls=1), "",
                  "1 fan-out, N = {} over N = {}: ".format(NS[-1], NS[0]) + "; ".join(
                      f"{label}: tree {ratio(predicted['refit'][label]['tree']):.2f}x, tree with "
                      f"relayed control {ratio(predicted['refit'][label]['tree, relayed control']):.2f}x"
                      for label in SIZES)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True)
    parser.add_argument("--hops")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    hops = Hops.read(args.hops) if args.hops and Path(args.hops).exists() else None
    print(summary(results, hops))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_plots(results, out)
        if hops is not None:
            plot_model(hops, out / "model.png", calls=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
