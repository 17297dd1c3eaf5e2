"""A refit's time against its number of workers N on a real cluster (each worker its own link),
predicted from per-hop figures measured on this machine (bench/refit_hops.py).

    .venv/bin/python bench/refit_cluster_model.py --hops out/scale/hops.json [--out out/scale]

The fan-out the fleet sends with (``[refit] fanout = "tree"``) is modelled against three others:

  tree       (chosen) pieces relayed down two binary trees (core/fanout.py): the trainer
             and every worker send at most the refit's bytes (and one piece), a piece crosses
             depth = floor(log2 N) + 1 hops.
  chain      a pipelined chain (as NCCL's ring broadcast): the bytes per link stay constant,
             but a piece crosses N hops.
  broadcast  the trainer sends every byte to each worker (gloo's broadcast): N x the bytes on
             its one link.
  waves      NeMo-RL's ModelExpress waves: every worker that holds the weights sends them whole
             to 4 more at once (its link shared 4 ways), so waves of 4^k: log5(N+1) waves.

A refit = its fixed part + its data part:

  fixed(N) = calls x (control_round + N x control_per_worker)      the driver's control fan-outs
           + 2 x depth x latency + N x header_per_worker            the header exchange (up the
                                                                    first tree and back down)
  relayed control (``[refit] control_relay_width`` = w, 8 by default: core/control_relay.py):
  where N > w, the driver calls w heads and each worker passes the call on to w children, the
  answers gathered back up; each level a round trip and w calls' CPU:
  fixed(N) = calls x levels(N, w) x (control_round + w x control_per_worker) + the header exchange
  with levels(N, w) the levels of a w-ary forest of w heads (w + w^2 + ... >= N); where N <= w,
  the driver's calls as above
  data     S bytes cut into pieces of c bytes; a piece through one link takes
           hop = piece_overhead + c / bandwidth
           tree:  (S/c) x hop + depth x (2 x hop + latency)         (an inner worker sends each
                                                                    of its tree's pieces twice)
           chain: (S/c) x hop + (N - 1) x (hop + latency)
           broadcast: N x (S/c) x hop
           waves: waves x (4 x S / bandwidth + control_round)

``calls`` = 3 as the scale bench measures the fixed part (prepare_refit_info, update_weights,
flush_cache); a trainer that sends the same refit info each step needs 1 (update_weights; the
update resets the cache itself). Every term is per refit; the group stays formed across refits.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import attrs
from rollout_fleet.core.control_relay import DEFAULT_RELAY_WIDTH

NS = (8, 16, 32, 64, 128, 256, 512, 1024)
SIZES = {"64 MiB": 64 << 20, "1 GiB": 1 << 30}
PIECE_BYTES = 4 << 20  # the gloo wire chunk (adapters/collective/wire.py)
FANOUTS = ("tree", "chain", "broadcast", "waves")
CONTROLS = ("driver", "relayed")  # who sends the control calls: the driver to all, or the trees
WAVE_WIDTH = 4  # concurrent pulls that saturate one source's link (the ModelExpress branch)


@attrs.frozen
class Hops:
    """The measured figures the model rests on (seconds, bytes per second)."""

    latency_s: float
    bandwidth_Bps: float
    piece_overhead_s: float
    header_per_worker_s: float
    control_per_worker_s: float
    control_round_s: float

    @classmethod
    def read(cls, path: str | Path) -> "Hops":
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: float(data[f.name]) for f in attrs.fields(cls)})

    def hop_s(self, piece_bytes: int) -> float:
        return self.piece_overhead_s + piece_bytes / self.bandwidth_Bps


def relay_levels(n: int, width: int) -> int:
    """Levels of the relay's forest over ``n`` workers: ``width`` heads, ``width`` children each."""
    levels, covered, level_size = 0, 0, 1
    while covered < n:
        level_size *= width
        covered += level_size
        levels += 1
    return levels


def fixed_s(hops: Hops, n: int, calls: int = 3, control: str = "driver",
            width: int = DEFAULT_RELAY_WIDTH) -> float:
    header = 2 * n.bit_length() * hops.latency_s + n * hops.header_per_worker_s
    if control == "relayed" and n > width:
        level_s = hops.control_round_s + width * hops.control_per_worker_s
        return calls * relay_levels(n, width) * level_s + header
    return calls * (hops.control_round_s + n * hops.control_per_worker_s) + header


def data_s(hops: Hops, n: int, size: int, fanout: str, piece: int = PIECE_BYTES) -> float:
    pieces = math.ceil(size / piece)
    piece = min(piece, size)
    hop = hops.hop_s(piece)
    if fanout == "tree":
        return pieces * hop + n.bit_length() * (2 * hop + hops.latency_s)
    if fanout == "chain":
        return pieces * hop + (n - 1) * (hop + hops.latency_s)
    if fanout == "broadcast":
        return n * pieces * hop
    if fanout == "waves":
        waves = math.ceil(math.log(n + 1, WAVE_WIDTH + 1) - 1e-9)
        return waves * (WAVE_WIDTH * size / hops.bandwidth_Bps + hops.control_round_s)
    raise ValueError(f"unknown fan-out {fanout!r}")


def refit_s(hops: Hops, n: int, size: int, fanout: str = "tree", calls: int = 3,
            control: str = "driver", width: int = DEFAULT_RELAY_WIDTH) -> float:
    return fixed_s(hops, n, calls, control, width) + data_s(hops, n, size, fanout)


def table(hops: Hops, calls: int = 3, width: int = DEFAULT_RELAY_WIDTH) -> dict:
    """Predicted seconds: the fixed part {control: {N: s}} and the refit {size: {column: {N:
    s}}}, a column per fan-out with the driver's control calls, and the tree with relayed ones."""
    columns = {**{fanout: (fanout, "driver") for fanout in FANOUTS},
               "tree, relayed control": ("tree", "relayed")}
    return {"fixed": {control: {n: fixed_s(hops, n, calls, control, width) for n in NS}
                      for control in CONTROLS},
            "refit": {label: {column: {n: refit_s(hops, n, size, fanout, calls, control, width)
                                       for n in NS}
                              for column, (fanout, control) in columns.items()}
                      for label, size in SIZES.items()}}


def ratio(series: dict[int, float]) -> float:
    return series[NS[-1]] / series[NS[0]]


def report(hops: Hops, calls: int = 3, width: int = DEFAULT_RELAY_WIDTH) -> str:
    predicted = table(hops, calls, width)
    lines = [f"per-hop figures: latency {hops.latency_s * 1e6:.0f} us, link "
             f"{hops.bandwidth_Bps / 1e9:.2f} GB/s, per-piece overhead "
             f"{hops.piece_overhead_s * 1e6:.0f} us ({PIECE_BYTES >> 20} MiB pieces), header "
             f"{hops.header_per_worker_s * 1e6:.1f} us/worker at the trainer, control "
             f"{hops.control_per_worker_s * 1e6:.0f} us/worker at the driver, a control's "
             f"round trip {hops.control_round_s * 1e3:.2f} ms; {calls} control fan-out(s) a refit; "
             f"relayed control: width {width}"]
    columns = list(predicted["refit"][next(iter(SIZES))])
    lines += ["", "| N | fixed s, driver | fixed s, relayed | " + " | ".join(
        f"{label} {column} s" for label in SIZES for column in columns) + " |",
        "|---" * (3 + len(SIZES) * len(columns)) + "|"]
    for n in NS:
        cells = [f"{predicted['refit'][label][column][n]:.3f}" for label in SIZES
                 for column in columns]
        lines.append(f"| {n} | {predicted['fixed']['driver'][n]:.4f} | "
                     f"{predicted['fixed']['relayed'][n]:.4f} | " + " | ".join(cells) + " |")
    cells = [f"{ratio(predicted['refit'][label][column]):.2f}x" for label in SIZES
             for column in columns]
    lines.append(f"| {NS[-1]}/{NS[0]} | {ratio(predicted['fixed']['driver']):.2f}x | "
                 f"{ratio(predicted['fixed']['relayed']):.2f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(hops: Hops, path: Path, calls: int = 3, width: int = DEFAULT_RELAY_WIDTH) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predicted = table(hops, calls, width)
    figure, axes = plt.subplots(figsize=(8, 4.2))
    for label in SIZES:
        for column, style in zip(predicted["refit"][label], ("-", "--", ":", "-.", "-")):
            series = predicted["refit"][label][column]
            axes.plot(list(series), list(series.values()), style, marker="o", markersize=3,
                      lw=2.5 if "relayed" in column else 1.2, label=f"{label}, {column}")
    for control, style in zip(CONTROLS, ("k-", "k--")):
        series = predicted["fixed"][control]
        axes.plot(list(series), list(series.values()), style, lw=1,
                  label=f"the fixed part, {control} control")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(NS, [str(n) for n in NS])
    axes.set_xlabel("workers (N), each with its own link")
    axes.set_ylabel("predicted refit seconds")
    axes.set_title("Cluster model: refit time by fan-out (per-hop figures measured here)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hops", required=True, help="bench/refit_hops.py's JSON")
    parser.add_argument("--calls", type=int, default=3, help="control fan-outs a refit")
    parser.add_argument("--relay-width", type=int, default=DEFAULT_RELAY_WIDTH,
                        help="[refit] control_relay_width: children per worker in the relay")
    parser.add_argument("--out", help="folder for model.json and model.png")
    args = parser.parse_args(argv)
    hops = Hops.read(args.hops)
    print(report(hops, args.calls, args.relay_width))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps(
            {"hops": attrs.asdict(hops), "calls": args.calls, "relay_width": args.relay_width,
             **table(hops, args.calls, args.relay_width)}, indent=1))
        print(f"wrote {plot(hops, out / 'model.png', args.calls, args.relay_width)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
