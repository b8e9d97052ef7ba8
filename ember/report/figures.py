"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no
global backend switch in the caller's process). Each figure keeps the exact series it plots, so tests
and the HTML's embedded JSON check the data, not pixels."""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator, PercentFormatter

from ember.report.runs import Run

FIGSIZE, DPI = (8.0, 4.5), 100  # every PNG is 800 x 450 pixels
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MOE_KEY = re.compile(r"^moe/layer(\d+)/tokens_per_expert$")

# run name -> curve label -> {"x": [...], "y": [...]}
SeriesData = dict[str, dict[str, dict[str, list]]]


@dataclass
class Plot:
    """One figure: its file stem, title, PNG bytes and the data behind every curve."""

    name: str
    title: str
    png: bytes
    series: SeriesData = field(default_factory=dict)


def smoothing_weight(n_points: int) -> float:
    """The EMA's weight of the past: 1 - 10/n, in [0, 0.9], so it averages over about the last tenth of the
    points. A fixed 0.8 (about 5 points) lagged the curve by ~0.3 nats over the default run's 20 records."""
    return min(0.9, max(0.0, 1 - 10 / max(n_points, 1)))


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing (the first points are not pulled to 0)."""
    out, last = [], 0.0
    for n, value in enumerate(values, start=1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight**n))
    return out


def _new_figure(ncols: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)  # no bbox_inches="tight": the size stays FIGSIZE x DPI
    return buffer.getvalue()


def _label(run: Run, curve: str, several: bool) -> str:
    return f"{run.name}: {curve}" if several else curve


def _finish(fig: Figure, axes: list[Axes], title: str) -> None:
    fig.suptitle(title)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")


def loss_plot(runs: list[Run], by_tokens: bool) -> Optional[Plot]:
    """Train loss (raw and smoothed), validation loss, loss spikes (x) and skipped steps (dotted lines)."""
    fig, (ax,) = _new_figure()
    series: SeriesData = {}
    several = len(runs) > 1
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        x_of: Callable[[list[int]], Optional[list[float]]] = run.steps_to_tokens if by_tokens else (lambda s: s)
        steps, loss = run.series("loss")
        x = x_of(steps)
        if x is None:
            continue  # no tokens_seen logged yet: nothing of this run on a tokens axis
        curves = series.setdefault(run.name, {})
        if steps:
            curves["train loss"] = {"x": x, "y": loss}
            weight = smoothing_weight(len(loss))
            curves["train loss (smoothed)"] = {"x": x, "y": smooth(loss, weight)}
            ax.plot(x, loss, color=color, alpha=0.3, linewidth=1)
            ax.plot(x, curves["train loss (smoothed)"]["y"], color=color, label=_label(run, "train", several))
        steps, val = run.series("val_loss")
        if steps:
            curves["val loss"] = {"x": x_of(steps), "y": val}
            ax.plot(curves["val loss"]["x"], val, color=color, linestyle="--", marker="o", markersize=4,
                    label=_label(run, "validation", several))
        steps, spikes = run.series("loss_spike")
        if steps:
            curves["loss spike"] = {"x": x_of(steps), "y": spikes}
            ax.scatter(curves["loss spike"]["x"], spikes, color=color, marker="x", s=60, zorder=3,
                       label=_label(run, "loss spike", several))
        skipped = sorted(run.values.get("skipped_step", {}))
        if skipped:
            curves["skipped step"] = {"x": x_of(skipped), "y": [None] * len(skipped)}
            for i, at in enumerate(curves["skipped step"]["x"]):
                ax.axvline(at, color=color, linestyle=":", alpha=0.8,
                           label=_label(run, "skipped step", several) if i == 0 else None)
        if not curves:
            del series[run.name]
    if not series:
        return None
    ax.set_xlabel("tokens seen" if by_tokens else "step")
    ax.set_ylabel("loss")
    if by_tokens:
        ax.xaxis.set_major_formatter(EngFormatter())
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    name, axis = ("loss_tokens", "tokens") if by_tokens else ("loss_steps", "steps")
    title = f"Loss vs {axis} (faint: raw; solid: smoothed, debiased EMA)"
    _finish(fig, [ax], title)
    return Plot(name, title, _png(fig), series)


def metric_plot(runs: list[Run], name: str, title: str, panels: list[tuple[str, str, bool]],
                log_y: bool = False) -> Optional[Plot]:
    """One panel per (metrics key, y label, is a fraction) against steps; None when no run logged any of them."""
    fig, axes = _new_figure(len(panels))
    series: SeriesData = {}
    several = len(runs) > 1
    for ax, (key, ylabel, fraction) in zip(axes, panels):
        for index, run in enumerate(runs):
            steps, values = run.series(key)
            if not steps:
                continue
            series.setdefault(run.name, {})[key] = {"x": steps, "y": values}
            ax.plot(steps, values, color=COLORS[index % len(COLORS)], marker="." if len(steps) < 30 else None,
                    label=run.name if several else None)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        if fraction:
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))  # the series stay fractions, as logged
        if log_y and ax.lines:
            ax.set_yscale("log")
    if not series:
        return None
    _finish(fig, axes, title)
    return Plot(name, title, _png(fig), series)


def expert_load(run: Run) -> dict[int, list[float]]:
    """MoE layer -> tokens routed to each expert, summed over every logged window (one record per step)."""
    load: dict[int, list[float]] = {}
    for key, by_step in run.values.items():
        match = MOE_KEY.match(key)
        if not match:
            continue
        for counts in by_step.values():
            if isinstance(counts, list):
                total = load.setdefault(int(match.group(1)), [0.0] * len(counts))
                for expert, count in enumerate(counts):
                    total[expert] += count
    return dict(sorted(load.items()))


def moe_plot(runs: list[Run]) -> Optional[Plot]:
    """Per-layer expert load as a heat map (one panel per MoE run): each layer's share of its tokens."""
    loads = [(run, expert_load(run)) for run in runs]
    loads = [(run, load) for run, load in loads if load]
    if not loads:
        return None
    fig, axes = _new_figure(len(loads))
    series: SeriesData = {}
    for ax, (run, load) in zip(axes, loads):
        layers = list(load)
        shares = [[count / (sum(counts) or 1) for count in counts] for counts in load.values()]
        series[run.name] = {f"layer{i}": {"x": list(range(len(counts))), "y": counts} for i, counts in load.items()}
        ax.grid(False)
        image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        n_experts = len(shares[0])
        ax.set_title(f"{run.name} (balanced: {1 / n_experts:.1%} each)", fontsize="small")
        fig.colorbar(image, ax=ax, format=PercentFormatter(xmax=1), label="share of the layer's tokens")
    title = "MoE expert load per layer, summed over the run"
    fig.suptitle(title)
    return Plot("moe_load", title, _png(fig), series)


def eval_plot(runs: list[Run]) -> Optional[Plot]:
    """eval.tasks results logged during training (eval/<task>/<metric>), one curve per run and metric."""
    fig, (ax,) = _new_figure()
    series: SeriesData = {}
    several = len(runs) > 1
    for index, run in enumerate(runs):
        for key in sorted(k for k in run.values if k.startswith("eval/")):
            steps, values = run.series(key)
            if steps:
                series.setdefault(run.name, {})[key] = {"x": steps, "y": values}
                ax.plot(steps, values, marker="o", color=COLORS[index % len(COLORS)] if several else None,
                        label=_label(run, key[5:], several))
    if not series:
        return None
    ax.set_xlabel("step")
    title = "Evaluation tasks during training"
    _finish(fig, [ax], title)
    return Plot("eval", title, _png(fig), series)


# What each figure needs in metrics.jsonl, said in the report when no run has it.
FIGURES: list[tuple[str, str]] = [
    ("loss_steps", "train loss (`loss`)"), ("loss_tokens", "`loss` with `tokens_seen`"), ("lr", "`lr`"),
    ("grad_norm", "`grad_norm`"), ("throughput", "`tokens_per_s` / `mfu`"), ("memory", "`memory_gb`"),
    ("data_wait", "`data_wait_frac`"), ("moe_load", "`moe/layer*/tokens_per_expert` (MoE runs only)"),
    ("eval", "`eval/*` (eval.tasks during training)"), ("grpo_reward", "`grpo/reward` (task=grpo only)"),
    ("grpo_completions", "`grpo/completion_length` (task=grpo only)"),
    ("grpo_policy", "`grpo/clipped_*`, `grpo/entropy` (task=grpo only)"),
    ("grpo_time", "`grpo/rollout_s`, `grpo/update_s` (task=grpo only)"),
]
OPTIONAL = {"moe_load", "eval", "grpo_reward", "grpo_completions", "grpo_policy",
            "grpo_time"}  # figures of runs of some kinds only: no note when they are absent


def all_plots(runs: list[Run]) -> list[Optional[Plot]]:
    """Every figure in FIGURES' order; None for one no run has data for."""
    return [
        loss_plot(runs, by_tokens=False),
        loss_plot(runs, by_tokens=True),
        metric_plot(runs, "lr", "Learning rate", [("lr", "learning rate", False)]),
        metric_plot(runs, "grad_norm", "Gradient norm (before clipping)", [("grad_norm", "grad norm", False)]),
        metric_plot(runs, "throughput", "Throughput and MFU",
                    [("tokens_per_s", "tokens/s (all devices)", False), ("mfu", "MFU", True)]),
        metric_plot(runs, "memory", "Peak memory", [("memory_gb", "GiB (peak, per process)", False)]),
        metric_plot(runs, "data_wait", "Share of step time waiting for data", [("data_wait_frac", "data wait", True)]),
        moe_plot(runs),
        eval_plot(runs),
        *grpo_plots(runs),
    ]


def grpo_plots(runs: list[Run]) -> list[Optional[Plot]]:
    """task=grpo's figures (ember/finetune/grpo.py's metrics): rewards, completions, the policy's clipping, KL and
    entropy, and where a step's time goes."""
    return [
        metric_plot(runs, "grpo_reward", "GRPO: reward of the sampled completions",
                    [("grpo/reward", "mean reward", False), ("grpo/reward_std", "mean std within a group", False),
                     ("grpo/zero_std_groups", "groups of equal rewards", True)]),
        metric_plot(runs, "grpo_completions", "GRPO: completions",
                    [("grpo/completion_length", "tokens (mean)", False),
                     ("grpo/truncated", "cut by max_new_tokens", True)]),
        metric_plot(runs, "grpo_policy", "GRPO: clipped ratios, KL to the reference, entropy",
                    [("grpo/clipped_high", "clipped high", True), ("grpo/clipped_low", "clipped low", True),
                     ("grpo/kl", "KL", False), ("grpo/entropy", "entropy (nats)", False)]),
        metric_plot(runs, "grpo_time", "GRPO: rollout and update time per logging window",
                    [("grpo/rollout_s", "rollout s", False), ("grpo/update_s", "update s", False)]),
    ]


def finite(value: Any) -> Any:
    """JSON has no NaN: None in its place (the embedded series must parse in a browser)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
