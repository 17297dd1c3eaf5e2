"""bench_scale.py's report: the figures against N as text (with the ratios between the smallest
and the largest N measured) and one PNG plot per figure."""

from __future__ import annotations

from pathlib import Path

KINDS = {"rr": "round-robin, file", "exec": "round-robin, exec",
         "kv": "KV router, file", "etcd": "round-robin, etcd"}


def measured(results: dict, kind: str, *path: str) -> list[tuple[int, object]]:
    """(N, value) for every N whose ``kind`` fleet measured ``path``."""
    points = []
    for n, by_kind in sorted(results["by_n"].items(), key=lambda item: int(item[0])):
        value = by_kind.get(kind, {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and not (isinstance(value, dict) and "skipped" in value):
            points.append((int(n), value))
    return points


def best_throughput(rows: list[dict]) -> dict | None:
    rows = [row for row in rows or [] if "rollouts_per_s" in row]
    return max(rows, key=lambda row: row["rollouts_per_s"]) if rows else None


def report(results: dict) -> str:
    lines = ["", "N     fleet               start s  stop s  worker RSS/USS/PSS MiB  idle cores  "
             "rollouts/s (in flight)  per-worker max/min, cv  cores: workers/frontend/driver "
             "(total); busiest process (cores, its busiest thread)"]
    for n, by_kind in sorted(results["by_n"].items(), key=lambda item: int(item[0])):
        for kind, fleet in by_kind.items():
            lines.append(f"{n:>4}  {KINDS[kind]:18s}  " + _fleet_columns(fleet))
    lines += _refit_lines(results) + _churn_lines(results) + _ratio_lines(results)
    return "\n".join(lines)


def _fleet_columns(fleet: dict) -> str:
    if "skipped" in fleet:
        return f"skipped: {fleet['skipped']}"
    memory = fleet.get("memory", {}).get("workers")
    mem = (f"{memory['rss_mib']['median']:.0f}/{memory['uss_mib']['median']:.0f}/"
           f"{memory['pss_mib']['median']:.0f}" if memory else "-")
    idle = f"{fleet['idle_cores']['total']:.2f}" if "idle_cores" in fleet else "-"
    best = best_throughput(fleet.get("throughput"))
    if best is None:
        rate = spread = cap = "-"
    else:
        rate = f"{best['rollouts_per_s']:.0f} ({best['in_flight']})"
        spread = f"{best['spread']['max_over_min']:.2f}, {best['spread']['cv']:.2f}"
        top = best["load"][0] if best["load"] else {}
        cores = best.get("cores", {})
        cap = (f"{cores.get('workers', 0):.2f}/{cores.get('frontend', 0):.2f}/"
               f"{cores.get('driver', 0):.2f} ({cores.get('total', 0):.2f}); "
               f"{top.get('process', '?')} ({top.get('cores', 0):.2f}, "
               f"{top.get('busiest_thread_share', 0):.2f})")
    return (f"{fleet['start_s']:7.1f}  {fleet.get('stop_s', 0):6.1f}  {mem:>22s}  {idle:>10s}  "
            f"{rate:>22s}  {spread:>23s}  {cap}")


def _refit_lines(results: dict) -> list[str]:
    fanout = results.get("args", {}).get("fanout", "broadcast")
    lines = ["", f"refit (round-robin fleet, {fanout} fan-out): the fixed part and each size's data"
             " part vs its floor"]
    for n, refit in measured(results, "rr", "refit"):
        fixed = (f"join first {refit['join_first_s']:.2f} s, again {refit['join_again_s']:.2f} s; "
                 f"prepare {refit['prepare_s']:.3f} s, 3 KiB update {refit['update_model_only_s']:.3f}"
                 f" s, flush {refit['flush_s']:.3f} s, one control to all {refit['control_s']:.3f} s"
                 f" ({refit.get('control_cpu_s_per_worker', 0) * 1e6:.0f} us of the driver's CPU"
                 " per worker)")
        sizes = "; ".join(f"{mib} MiB: {size['update_s']:.2f} s, data {size['data_s']:.2f} s = "
                          f"{size['data_over_floor']:.1f}x the floor {size['floor_s']:.2f} s"
                          for mib, size in refit["sizes"].items())
        after = refit["memory_after"]["workers"]
        lines.append(f"{n:>4}  {fixed}\n      {sizes}\n      per worker after it: RSS "
                     f"{after['rss_mib']['median']:.0f} MiB, USS {after['uss_mib']['median']:.0f},"
                     f" PSS {after['pss_mib']['median']:.0f} (median)")
    return lines + _skipped(results, "refit")


def _skipped(results: dict, part: str) -> list[str]:
    return [f"{n:>4}  skipped: {by_kind['rr'][part]['skipped']}"
            for n, by_kind in results["by_n"].items()
            if "skipped" in by_kind.get("rr", {}).get(part, {})]


def _churn_lines(results: dict) -> list[str]:
    lines = ["", "churn (round-robin fleet, lost workers replaced)"]
    for n, churn in measured(results, "rr", "churn"):
        lines.append(f"{n:>4}  killed {len(churn['killed'])} under {churn['rollouts']} rollouts: "
                     f"lost {churn['lost']}, duplicated {churn['duplicated']}; replacements "
                     f"registered {churn['replaced_s']:.1f} s after the kill; next refit "
                     f"{churn['refit_s']:.1f} s, versions equal {churn['versions_equal']}; every "
                     f"replacement served {all(churn['replacements_served'].values())} "
                     f"({churn['serving_s']:.1f} s after the refit)")
    return lines + _skipped(results, "churn")


def _ratio_lines(results: dict) -> list[str]:
    starts = measured(results, "rr", "start_s")
    if len(starts) < 2:
        return []
    (n0, _), (n1, _) = starts[0], starts[-1]
    lines = ["", f"ratios, N = {n1} over N = {n0} ({n1 / n0:.0f}x the workers)"]

    def ratio(name: str, points: list[tuple[int, float]]) -> None:
        values = dict(points)
        if n0 in values and n1 in values and values[n0]:
            lines.append(f"  {name}: {values[n1] / values[n0]:.2f}x")

    for kind in KINDS:
        ratio(f"start ({KINDS[kind]})", measured(results, kind, "start_s"))
    ratio("worker USS (median)", [(n, m["workers"]["uss_mib"]["median"])
                                  for n, m in measured(results, "rr", "memory")])
    ratio("best rollouts/s (round-robin)", [(n, best_throughput(rows)["rollouts_per_s"])
                                            for n, rows in measured(results, "rr", "throughput")
                                            if best_throughput(rows)])
    refits = measured(results, "rr", "refit")
    ratio("refit fixed part", [(n, r["fixed_s"]) for n, r in refits])
    ratio("refit first join", [(n, r["join_first_s"]) for n, r in refits])
    for mib in (refits[0][1]["sizes"] if refits else {}):
        ratio(f"refit {mib} MiB data part", [(n, r["sizes"][mib]["data_s"]) for n, r in refits])
    return lines


# -- plots ---------------------------------------------------------------------------------------
def write_plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in (("start", _plot_start), ("memory", _plot_memory), ("cpu", _plot_cpu),
                       ("throughput", _plot_throughput), ("fairness", _plot_fairness),
                       ("refit", _plot_refit), ("churn", _plot_churn),
                       ("discovery", _plot_discovery)):
        figure, axes = plt.subplots(figsize=(10, 4.5))
        if draw(results, axes):
            ns = sorted(int(n) for n in results["by_n"])
            axes.set_xscale("log", base=2)
            axes.set_xticks(ns, [str(n) for n in ns])
            axes.set_xlabel("workers (N)")
            axes.grid(alpha=0.3)
            axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            figure.tight_layout()
            path = out / f"{name}.png"
            figure.savefig(path, dpi=110)
            written.append(path)
        plt.close(figure)
    return written


def _line(axes, points, label: str, **style) -> bool:
    if not points:
        return False
    axes.plot([n for n, _ in points], [v for _, v in points], marker="o", label=label, **style)
    return True


def _plot_start(results: dict, axes) -> bool:
    drawn = [_line(axes, measured(results, kind, "start_s"), f"start, {KINDS[kind]}")
             for kind in KINDS]
    drawn.append(_line(axes, measured(results, "rr", "stop_s"), "stop, round-robin", ls="--"))
    axes.set_ylabel("seconds")
    axes.set_title("Fleet start (every worker registered) and stop")
    return any(drawn)


def _plot_memory(results: dict, axes) -> bool:
    drawn = []
    for key, label in (("rss_mib", "RSS"), ("uss_mib", "USS"), ("pss_mib", "PSS")):
        drawn.append(_line(axes, [(n, m["workers"][key]["median"])
                                  for n, m in measured(results, "rr", "memory")], f"{label}, idle"))
        drawn.append(_line(axes, [(n, r["memory_after"]["workers"][key]["median"])
                                  for n, r in measured(results, "rr", "refit")],
                           f"{label}, after a refit (torch)", ls="--"))
    axes.set_ylabel("MiB per worker process (median)")
    axes.set_title("Memory of one memory-engine worker")
    return any(drawn)


def _plot_cpu(results: dict, axes) -> bool:
    drawn = [_line(axes, [(n, c["total"]) for n, c in measured(results, "rr", "idle_cores")],
                   "idle: the whole fleet")]
    for role in ("workers", "frontend", "driver", "total"):
        points = [(n, best_throughput(rows).get("cores", {}).get(role, 0.0))
                  for n, rows in measured(results, "rr", "throughput") if best_throughput(rows)]
        drawn.append(_line(axes, points, f"at its best rollouts/s: {role}", ls="--"))
    axes.set_ylabel("cores (CPU seconds per second)")
    axes.set_title("Where the CPU goes (round-robin fleet)")
    return any(drawn)


def _plot_throughput(results: dict, axes) -> bool:
    drawn = []
    for kind in KINDS:
        levels = sorted({row["in_flight"] for _, rows in measured(results, kind, "throughput")
                         for row in rows if "rollouts_per_s" in row})
        for level in levels:
            points = [(n, row["rollouts_per_s"]) for n, rows in measured(results, kind, "throughput")
                      for row in rows if row.get("in_flight") == level and "rollouts_per_s" in row]
            drawn.append(_line(axes, points, f"{KINDS[kind]}, {level} in flight"))
    axes.set_ylabel("16-token rollouts/s")
    axes.set_title("Throughput through the frontend and the driver")
    return any(drawn)


def _plot_fairness(results: dict, axes) -> bool:
    drawn = []
    for kind in ("rr", "kv"):
        points = [(n, best_throughput(rows)["spread"]["cv"])
                  for n, rows in measured(results, kind, "throughput") if best_throughput(rows)]
        drawn.append(_line(axes, points, f"{KINDS[kind]}: cv of rollouts per worker"))
    axes.set_ylabel("coefficient of variation")
    axes.set_title("Routing fairness (0: every worker served the same)")
    return any(drawn)


def _plot_refit(results: dict, axes) -> bool:
    refits = measured(results, "rr", "refit")
    drawn = [_line(axes, [(n, r["fixed_s"]) for n, r in refits], "fixed: prepare + 3 KiB update + flush"),
             _line(axes, [(n, r["join_first_s"]) for n, r in refits], "first join (torch import)"),
             _line(axes, [(n, r["join_again_s"]) for n, r in refits], "a later join")]
    for mib in (refits[0][1]["sizes"] if refits else {}):
        drawn.append(_line(axes, [(n, r["sizes"][mib]["data_s"]) for n, r in refits],
                           f"{mib} MiB: data part"))
        drawn.append(_line(axes, [(n, r["sizes"][mib]["floor_s"]) for n, r in refits],
                           f"{mib} MiB: floor N x bytes / copy bandwidth", ls=":"))
    axes.set_yscale("log")
    axes.set_ylabel("seconds")
    axes.set_title("Refit to every worker: fixed and data parts")
    return any(drawn)


def _plot_churn(results: dict, axes) -> bool:
    churns = measured(results, "rr", "churn")
    drawn = [_line(axes, [(n, c["replaced_s"]) for n, c in churns], "kill -> replacements registered"),
             _line(axes, [(n, c["refit_s"]) for n, c in churns], "next refit (replacements in)"),
             _line(axes, [(n, c["serving_s"]) for n, c in churns], "refit -> every replacement served")]
    for n, churn in churns:
        axes.annotate(f"lost {churn['lost']}, dup {churn['duplicated']}", (n, churn["replaced_s"]),
                      fontsize=7)
    axes.set_ylabel("seconds")
    axes.set_title("Churn: 10% of the workers killed under load")
    return any(drawn)


def _plot_discovery(results: dict, axes) -> bool:
    drawn = []
    for kind in ("rr", "etcd"):
        drawn.append(_line(axes, measured(results, kind, "start_s"), f"start s, {KINDS[kind]}"))
        points = [(n, best_throughput(rows)["rollouts_per_s"] / 1000)
                  for n, rows in measured(results, kind, "throughput") if best_throughput(rows)]
        drawn.append(_line(axes, points, f"thousand rollouts/s, {KINDS[kind]}", ls="--"))
    axes.set_title("Discovery: a shared file vs etcd")
    return any(drawn)
