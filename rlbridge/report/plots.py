"""The report's PNGs (matplotlib, Agg backend; the only module that imports matplotlib).

Every file of PLOTS is written for every run, so a reader (or a test) never meets a missing file: a metric
the run did not log (KL with kl.coef 0, a crash before the first step) gets a panel that says so.
Figures are `matplotlib.figure.Figure`s on an Agg canvas: no pyplot global state, no GUI backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlbridge.errors import RlbridgeError
from rlbridge.report.run import RunData

PLOTS: dict[str, str] = {
    "reward.png": "reward and accuracy",
    "kl.png": "KL to the reference policy",
    "entropy.png": "policy entropy",
    "grad_norm.png": "gradient norm",
    "step_time.png": "step time per phase",
    "tokens_per_s.png": "throughput",
}
SKIP_PHASES = ("time_step", "time_eval")
BAR_LIMIT = 150
"""Up to this many steps the phase times are stacked bars; beyond, a stacked area."""


def _figure(rows: int = 1) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RlbridgeError(f"plots need matplotlib ({e}): pip install 'rlbridge-cli[report]'") from None
    fig = Figure(figsize=(8, 3.2 * rows + 0.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend for this figure only: no pyplot, no global backend switch
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _has(ys: list[float]) -> bool:
    return any(math.isfinite(y) for y in ys)


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_yticks([])


def _line(ax: Any, run: RunData, key: str, label: str, *, missing: str, color: str = "C0") -> bool:
    xs, ys = _series(run.train, key)
    if not _has(ys):
        _empty(ax, missing)
        return False
    ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, markersize=3, color=color, label=label)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    return True


def _save(fig: Any, run: RunData, title: str, path: Path) -> Path:
    name = run.get("name", run.run_dir.name)
    fig.suptitle(
        f"{name}: {title}  ({run.status.state}, step {run.steps_done}/{run.steps_planned or '?'})",
        fontsize=10,
    )
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.axes[-1].set_xlabel("step")
    fig.savefig(path)
    return path


def _reward(run: RunData, path: Path) -> Path:
    fig, (top, bottom) = _figure(2)
    xs, mean = _series(run.train, "reward_mean")
    if _line(top, run, "reward_mean", "reward (mean)", missing="no training step logged yet"):
        sx, std = _series(run.train, "reward_std")
        if sx == xs and _has(std):
            top.fill_between(
                xs,
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                alpha=0.2,
                color="C0",
                label="± std",
            )
        top.legend(loc="best", fontsize=8)
    from rlbridge.metrics.evals import eval_columns

    ax_x, acc = _series(run.train, "accuracy")
    rates = [(c.label, *_series(run.evals, c.key)) for c in eval_columns(run.recipe, run.evals) if c.is_rate]
    rates = [(label, x, y) for label, x, y in rates if _has(y)]
    if not (_has(acc) or rates):
        _empty(bottom, "no accuracy logged yet")
    else:
        if _has(acc):
            bottom.plot(
                ax_x,
                acc,
                color="C1",
                marker="o" if len(ax_x) < 40 else None,
                markersize=3,
                label="train accuracy (sampled)",
            )
        for j, (label, ex, ey) in enumerate(rates):  # the recipe's eval.metrics that are pass rates
            bottom.plot(ex, ey, "os^Dv"[j % 5] + "--", color=f"C{2 + j}", markersize=6, label=f"eval {label}")
        bottom.set_ylim(-0.03, 1.03)
        bottom.set_ylabel("fraction")
        bottom.grid(alpha=0.3)
        bottom.legend(loc="best", fontsize=8)
    return _save(fig, run, PLOTS["reward.png"], path)


def _single(run: RunData, path: Path, key: str, label: str, missing: str) -> Path:
    fig, (ax,) = _figure(1)
    _line(ax, run, key, label, missing=missing)
    return _save(fig, run, PLOTS[path.name], path)


def _grad_norm(run: RunData, path: Path) -> Path:
    fig, (ax,) = _figure(1)
    if _line(ax, run, "grad_norm", "grad norm", missing="no gradient norm logged yet"):
        clip = run.get("trainer.optim.clip_grad")
        if isinstance(clip, (int, float)):
            ax.axhline(
                clip, color="0.5", linestyle="--", linewidth=1, label=f"trainer.optim.clip_grad {clip}"
            )
        skipped = [int(r["step"]) for r in run.train if r.get("skipped")]
        if skipped:
            ax.scatter(
                skipped,
                [0.0] * len(skipped),
                marker="x",
                color="C3",
                label="skipped step (non-finite)",
                zorder=3,
            )
        ax.legend(loc="best", fontsize=8)
    return _save(fig, run, PLOTS["grad_norm.png"], path)


def phase_keys(run: RunData) -> list[str]:
    """time_<phase> keys in the order the loop first logged them."""
    keys: list[str] = []
    for r in run.train:
        for k in r:
            if k.startswith("time_") and k not in SKIP_PHASES and k not in keys:
                keys.append(k)
    return keys


def _step_time(run: RunData, path: Path) -> Path:
    fig, (ax,) = _figure(1)
    keys = phase_keys(run)
    if not keys or not run.train:
        _empty(ax, "no step timed yet")
        return _save(fig, run, PLOTS["step_time.png"], path)
    steps = [int(r["step"]) for r in run.train]
    values = [
        [float(r.get(k) or 0.0) if isinstance(r.get(k), (int, float)) else 0.0 for r in run.train]
        for k in keys
    ]
    labels = [k.removeprefix("time_") for k in keys]
    if len(steps) <= BAR_LIMIT:
        bottom = [0.0] * len(steps)
        for i, (vals, label) in enumerate(zip(values, labels, strict=True)):
            ax.bar(steps, vals, bottom=bottom, width=0.8, color=f"C{i % 10}", label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    else:
        ax.stackplot(steps, values, labels=labels, colors=[f"C{i % 10}" for i in range(len(keys))])
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, run, PLOTS["step_time.png"], path)


def draw_plots(run: RunData, out: Path) -> list[Path]:
    return [
        _reward(run, out / "reward.png"),
        _single(run, out / "kl.png", "kl", "KL", "no KL logged (algorithm.kl.coef is 0, or no step yet)"),
        _single(run, out / "entropy.png", "entropy", "entropy (nats/token)", "no entropy logged yet"),
        _grad_norm(run, out / "grad_norm.png"),
        _step_time(run, out / "step_time.png"),
        _single(
            run, out / "tokens_per_s.png", "tokens_per_s", "response tokens / s", "no throughput logged yet"
        ),
    ]
