#!/usr/bin/env python3
"""Draw the plots of docs/results.md from the CSV files in docs/data/.

Every CSV starts with '#' lines naming the command, machine, date and build its
numbers came from (copied from the notebook, docs/results.md's git history);
this script only draws them. Each plot's title names the machine, its subtitle
the source file.

  scripts/plot-results.py [-d DATADIR] [-o IMGDIR] [PLOT...]

PLOT is any of: put_signal_stream, put_signal_batch, moe, coll, tile (default: all).
Needs python3 and matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOTS = ("put_signal_stream", "put_signal_batch", "moe", "coll", "tile")


def read_csv(path):
    """Rows of a CSV as dicts, the leading '#' comment lines skipped."""
    with open(path, newline="") as f:
        lines = [l for l in f if not l.startswith("#")]
    return list(csv.DictReader(lines))


def num(s):
    return float(s) if s not in (None, "") else None


def column_values(rows, key):
    """The distinct values of a column, in the order they first appear."""
    return list(dict.fromkeys(r[key] for r in rows))


def save(fig, imgdir, name):
    path = os.path.join(imgdir, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print("wrote", os.path.relpath(path, os.getcwd()))


def plot_put_signal_stream(plt, datadir, imgdir):
    rows = read_csv(os.path.join(datadir, "put_signal_latency_model_stream.csv"))
    sizes = sorted({int(r["tile_KiB"]) for r in rows})
    strategies = ["ordered", "target", "deferred"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.25
    for i, s in enumerate(strategies):
        ys = [num(next(r["speedup_vs_drain"] for r in rows
                       if r["strategy"] == s and int(r["tile_KiB"]) == z)) for z in sizes]
        xs = [k + (i - 1) * width for k in range(len(sizes))]
        bars = ax.bar(xs, ys, width, label=s)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.03, "%.2fx" % y, ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", lw=1, ls="--", label="drain (= 1.0)")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels(["%d KiB" % z for z in sizes])
    ax.set_xlabel("tile size (8 tiles, then one signal, per batch)")
    ax.set_ylabel("speedup vs drain (drain's time per batch / strategy's)")
    ax.set_ylim(0, 2.6)
    ax.set_title("perseus_put_signal_perf, stream mode, model NIC latency 500 us\n"
                 "dev machine (2 cores), 2 ranks, tcp;ofi_rxm on lo, 2026-11-23",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    save(fig, imgdir, "put_signal_speedup_vs_tile.png")
    plt.close(fig)


def plot_put_signal_batch(plt, datadir, imgdir):
    rows = read_csv(os.path.join(datadir, "put_signal_latency_model_batch.csv"))
    ds = [int(r["latency_D_us"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s, m in (("ordered", "o"), ("target", "s"), ("deferred", "^"), ("drain", "x")):
        ax.plot(range(len(ds)), [num(r[s + "_us"]) for r in rows], marker=m, label=s)
    ax.set_xticks(range(len(ds)))
    ax.set_xticklabels([str(d) for d in ds])
    ax.set_yscale("log")
    ax.set_xlabel("model NIC latency D (PERSEUS_TEST_LATENCY_US, us)")
    ax.set_ylabel("latency of one batch (alpha of the fit, us, log)")
    ax.set_title("perseus_put_signal_perf, batch mode, 64 KiB tiles\n"
                 "dev machine (2 cores), 2 ranks, tcp;ofi_rxm on lo, 2026-11-23",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, imgdir, "put_signal_batch_latency.png")
    plt.close(fig)


def plot_moe(plt, datadir, imgdir):
    rows = read_csv(os.path.join(datadir, "moe_fused_vs_baseline.csv"))
    configs = column_values(rows, "config")
    presets = ["Qwen-like", "GPT-OSS-like", "DeepSeek-like"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    width = 0.8 / len(configs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, phase in zip(axes, ("decode", "prefill")):
        for i, c in enumerate(configs):
            for k, p in enumerate(presets):
                r = next(r for r in rows
                         if r["config"] == c and r["phase"] == phase and r["preset"] == p)
                x = k + (i - (len(configs) - 1) / 2) * width
                lo, hi = num(r["speedup_lo"]), num(r["speedup_hi"])
                label = c if k == 0 else None
                if lo is None:
                    ax.text(x, 0.05, "n/a", ha="center", va="bottom", fontsize=7,
                            rotation=90, color=colors[i % len(colors)])
                    continue
                ax.bar(x, lo, width, color=colors[i % len(colors)], label=label)
                if hi > lo:  # a range over rounds: the bar to the low end, hatched to the high
                    ax.bar(x, hi - lo, width, bottom=lo, color="white",
                           edgecolor=colors[i % len(colors)], hatch="///")
                    txt = "%.2f-%.2fx" % (lo, hi)
                else:
                    txt = "%.2fx" % lo
                ax.text(x, hi + 0.03, txt, ha="center", va="bottom", fontsize=7,
                        rotation=90)
        ax.axhline(1.0, color="black", lw=1, ls="--")
        ax.set_xticks(range(len(presets)))
        ax.set_xticklabels(presets)
        ax.set_title("%s (%s tokens a rank)" % (phase, "128" if phase == "decode" else "4,096"))
        ax.set_ylim(0, 2.45)
    axes[0].set_ylabel("speedup: faster baseline's time / fused time")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(configs), fontsize=8,
               bbox_to_anchor=(0.5, -0.06))
    fig.text(0.5, -0.1, "hatched: the range over rounds (the baseline's spread); "
             "dashed line: as fast as the baseline", ha="center", fontsize=8)
    fig.suptitle("perseus_moe_perf: fused MoE layer vs the NCCL + cuBLAS baseline "
                 "(latest run of each configuration; n/a = not run or does not fit)",
                 fontsize=10)
    save(fig, imgdir, "moe_fused_vs_baseline.png")
    plt.close(fig)


def plot_coll(plt, datadir, imgdir):
    rows = read_csv(os.path.join(datadir, "coll_perf_2xh200.csv"))
    colls = column_values(rows, "collective")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c, m in zip(colls, "osx^D"):
        rs = [r for r in rows if r["collective"] == c]
        ax.plot([int(r["size_B"]) for r in rs],
                [num(r["ratio_busbw_p_over_s"]) for r in rs], marker=m, label=c)
    ax.set_xscale("log", base=2)
    sizes = sorted({int(r["size_B"]) for r in rows})
    ax.set_xticks(sizes)
    ax.set_xticklabels([("%d MiB" % (s >> 20)) if s < (1 << 30) else "1 GiB" for s in sizes],
                       rotation=45, fontsize=8)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.axvline(64 << 20, color="grey", lw=1, ls=":")
    ax.text(64 << 20, 0.66, " target: >= 1.0 from 64 MiB", fontsize=8, color="grey")
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw perseus / busbw NCCL Socket")
    ax.set_ylim(0.6, 1.6)
    ax.set_title("perseus_coll_perf: NCCL collectives, perseus vs Socket, loopback TCP\n"
                 "2 x H200 (nvidia-h200-x2), NCCL 2.28.9, passthru on, 2026-11-21",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    save(fig, imgdir, "coll_perf_ratio_vs_size.png")
    plt.close(fig)


def plot_tile(plt, datadir, imgdir):
    rows = read_csv(os.path.join(datadir, "tile_perf_4xh200.csv"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"lsa": "o", "tma": "s", "gin": "^"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, path in enumerate(("lsa", "tma", "gin")):
        for b, ls in (("1", "-"), ("64", "--")):
            rs = [r for r in rows if r["batch"] == b]
            ax.plot([int(r["size_KiB"]) for r in rs], [num(r[path + "_Mtiles_s"]) for r in rs],
                    marker=styles[path], ls=ls, color=colors[i],
                    label="%s, B=%s (a signal per %s)" % (path, b, "tile" if b == "1" else b + " tiles"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([4, 16, 64, 256])
    ax.set_xticklabels(["4 KiB", "16 KiB", "64 KiB", "256 KiB"])
    ax.set_xlabel("tile size")
    ax.set_ylabel("Mtiles/s, all ranks (log)")
    ax.set_title("perseus_tile_perf: tile puts with batched signals, 4 GPUs, CTA coops\n"
                 "4 x H200 (nvidia-h200-x4), lsa/tma over NVLink, gin via the proxy on loopback TCP, 2026-11-21",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="center right")
    save(fig, imgdir, "tile_perf_vs_size.png")
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(
        description="Draw docs/results.md's plots from docs/data/*.csv into docs/img/*.png.",
        usage="scripts/plot-results.py [-h] [-d DATADIR] [-o IMGDIR] [PLOT ...]  "
              "(PLOT: %s; default all)" % ", ".join(PLOTS))
    ap.add_argument("-d", "--data", default=os.path.join(ROOT, "docs", "data"),
                    help="folder of the CSV files (default docs/data)")
    ap.add_argument("-o", "--out", default=os.path.join(ROOT, "docs", "img"),
                    help="folder for the PNG files (default docs/img)")
    ap.add_argument("plots", nargs="*", metavar="PLOT",
                    help="which plots: %s (default: all)" % ", ".join(PLOTS))
    args = ap.parse_args()
    for p in args.plots:
        if p not in PLOTS:
            ap.error("unknown plot %r; expected one of: %s" % (p, ", ".join(PLOTS)))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot-results.py: matplotlib is not installed for %s; install it "
                 "(Debian/Ubuntu: apt-get install -y python3-matplotlib) and run this "
                 "script with that python3 (e.g. /usr/bin/python3 scripts/plot-results.py)"
                 % sys.executable)
    os.makedirs(args.out, exist_ok=True)
    for p in args.plots or PLOTS:
        globals()["plot_" + p](plt, args.data, args.out)


if __name__ == "__main__":
    main()
