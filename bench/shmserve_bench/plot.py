"""PNG charts (matplotlib, imported only here, Agg backend): latency against
throughput across the sweep, and the latency CDF of every level."""
from __future__ import annotations

from pathlib import Path

from . import stats as S


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'shmserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_vs_throughput(results, path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for tr in results:
        lv = [x for x in tr.levels if x.summary["n"]]
        if not lv:
            continue
        x = [v.summary["throughput"] for v in lv]
        for key, style in (("p50", "-o"), ("p99", "--^")):
            line, = ax.plot(x, [v.summary["latency_us"][key] for v in lv], style, ms=4,
                            label=f"{tr.label} {key}")
            if key == "p50":
                for v, xx in zip(lv, x):
                    ax.annotate(f"{v.value:g}", (xx, v.summary["latency_us"][key]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("throughput (infer/s)")
    ax.set_ylabel("latency (us)")
    ax.set_yscale("log")
    return _save(plt, fig, ax, path, title or "latency vs throughput (labels: concurrency or rate)")


def latency_cdf(results, path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for tr in results:
        for lv in tr.levels:
            if lv.latencies_us is None or not len(lv.latencies_us):
                continue
            x, q = S.cdf(lv.latencies_us)
            name = f"{lv.value:g}" if lv.mode == "concurrency" else f"{lv.value:g}/s"
            ax.plot(x, q, label=f"{tr.label} @ {name}", lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("latency (us)")
    ax.set_ylabel("fraction of requests")
    return _save(plt, fig, ax, path, title or "latency CDF")


def _save(plt, fig, ax, path: Path, title: str) -> Path:
    """The finish every chart shares: grid, title, legend, tight layout, PNG."""
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(results, out_dir, prefix: str = "", title: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [latency_vs_throughput(results, out / f"{prefix}latency_vs_throughput.png", title),
            latency_cdf(results, out / f"{prefix}latency_cdf.png", title)]
