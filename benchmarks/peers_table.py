"""benchmarks/peers.py's rows: a framework's rounds summed up into a row of the results file, the table printed,
and the summary of ember against the fastest peer. The rows' keys are the results file's (peers-<device>.json),
which docs/performance.md renders: keep them as they are."""

from __future__ import annotations

import statistics
from typing import Any

from peers_frameworks import RUNNERS, SHAPES

# The mode each peer's users get by default: what eager ember is held against in the summary.
DEFAULT_MODE = {name: runner.default_mode for name, runner in RUNNERS.items() if runner.default_mode}
ROUND_KEYS = ("status", "tokens_per_s", "train_rss_kib", "peak_rss_kib", "step_times_s")


def not_run(shape: str, precision: str, mode: str, framework: str, status: str, reason: str) -> dict[str, Any]:
    """The row of a framework that was not run here (`skipped`: bf16 on this CPU; `n/a`: no such mode)."""
    return {"shape": shape, "precision": precision, "mode": mode, "framework": framework, "status": status,
            "tokens_per_s": None, "step_ms": None, "train_rss_mib": None, "peak_rss_mib": None, "ember_ratio": None,
            "noisy": None, "step_spread": None, "params": None, "reason": reason}


def summarize(shape: str, precision: str, mode: str, framework: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A table row: the median over the rounds that ran (tokens/s, step, peak RSS) and every round's raw times."""
    ok = [r for r in rounds if r["status"] == "ok"]
    row = not_run(shape, precision, mode, framework, "ok" if ok else "failed",
                  "; ".join(f"round {i + 1}: {r['reason']}" for i, r in enumerate(rounds) if r["status"] != "ok")
                  or None)
    row["params"] = next((r["params"] for r in rounds if r["params"]), None)
    if ok:
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in ok)
        row |= {"tokens_per_s": tokens_per_s, "step_ms": SHAPES[shape].batch * SHAPES[shape].seq / tokens_per_s * 1e3,
                "peak_rss_mib": statistics.median(r["peak_rss_kib"] for r in ok) / 1024}
        train = [r["train_rss_kib"] for r in ok if r.get("train_rss_kib")]
        row["train_rss_mib"] = statistics.median(train) / 1024 if train else None
        # the widest round: one noisy round is enough to doubt the median, as its warning said
        row |= {"noisy": any(r["noisy"] for r in ok), "step_spread": max(r["step_spread"] for r in ok)}
    row["rounds"] = [{key: r.get(key) for key in ROUND_KEYS} for r in rounds]
    return row


def add_ember_ratios(rows: list[dict[str, Any]]) -> None:
    """Each peer row's `ember_ratio`: ember's tokens/s over the row's, where both ran."""
    by_key = {(r["shape"], r["precision"], r["mode"], r["framework"]): r for r in rows}
    for row in rows:
        ember = by_key.get((row["shape"], row["precision"], row["mode"], "ember"))
        if row["framework"] != "ember" and row["tokens_per_s"] and ember and ember["tokens_per_s"]:
            row["ember_ratio"] = ember["tokens_per_s"] / row["tokens_per_s"]


def summary_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[tuple[dict[str, Any], str]]]]:
    """(ember's measured row, [(each measured peer row it is held against, that row's mode)]) per (shape,
    precision, mode) where ember and a peer both ran: eager ember against each peer's default mode (litgpt
    compiled, torchtitan eager), compiled ember against the compiled peers."""
    by_key = {(r["shape"], r["precision"], r["mode"], r["framework"]): r for r in rows if r["tokens_per_s"]}
    pairs = []
    for (shape, precision, mode, framework), ember in by_key.items():
        if framework != "ember":
            continue
        peers = [(by_key[key], key[2]) for peer in DEFAULT_MODE
                 if (key := (shape, precision, DEFAULT_MODE[peer] if mode == "eager" else "compiled", peer)) in by_key]
        if peers:
            pairs.append((ember, peers))
    return pairs


def summary_heading(rows: list[dict[str, Any]]) -> str:
    """The summary's first line: for each mode of ember that was held against a peer, the peers (and their
    modes) it was held against, and nothing about a mode or a peer that did not run."""
    pairs = summary_pairs(rows)
    eager = {peer["framework"] for ember, peers in pairs if ember["mode"] == "eager" for peer, _ in peers}
    compiled = {peer["framework"] for ember, peers in pairs if ember["mode"] == "compiled" for peer, _ in peers}
    parts = []
    if eager:
        ran = [f"{peer} {mode}" for peer, mode in DEFAULT_MODE.items() if peer in eager]
        defaults = "their defaults" if len(ran) > 1 else "its default"
        parts.append(f"eager ember against {' and '.join(ran)}, {defaults}")
    if compiled:
        parts.append(f"compiled ember against compiled {' and '.join(p for p in DEFAULT_MODE if p in compiled)}")
    return f"ember vs fastest peer ({'; '.join(parts)}):" if parts else "ember vs fastest peer:"


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`ember vs fastest peer` per (shape, precision, mode) (see summary_pairs), a noisy side's step-time spread
    after it, and the training RSS beside the lowest peer's."""
    lines = []
    for ember, peers in summary_pairs(rows):
        shape, precision, mode = ember["shape"], ember["precision"], ember["mode"]
        fastest, peer_mode = max(peers, key=lambda p: p[0]["tokens_per_s"])
        # a noisy median is said where the figure is read, not only in the warnings above the table
        noisy = [f"{r['framework']} step times vary {r['step_spread']:.1f}x" for r in (ember, fastest) if r["noisy"]]
        lines.append(f"{shape} {precision} {mode}: ember {ember['tokens_per_s']:,.0f} tok/s vs fastest peer "
                     f"{fastest['framework']} ({peer_mode}) {fastest['tokens_per_s']:,.0f} tok/s: "
                     f"{ember['tokens_per_s'] / fastest['tokens_per_s']:.2f}x"
                     + (f" (noisy: {', '.join(noisy)})" if noisy else ""))
        memories = [(p["train_rss_mib"], p["framework"]) for p, _ in peers if p["train_rss_mib"]]
        if memories and ember["train_rss_mib"]:
            lowest, name = min(memories)
            lines.append(f"{shape} {precision} {mode}: training RSS ember {ember['train_rss_mib']:,.0f} MiB vs "
                         f"lowest peer {name} {lowest:,.0f} MiB: {ember['train_rss_mib'] / lowest:.2f}x")
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<7}{'precision':<10}{'mode':<10}{'framework':<12}{'params':>12}{'tokens/s':>11}"
          f"{'step ms':>10}{'train RSS MiB':>15}{'peak RSS MiB':>14}{'ember/this':>12}")
    for r in rows:
        head = f"{r['shape']:<7}{r['precision']:<10}{r['mode']:<10}{r['framework']:<12}"
        if r["tokens_per_s"] is None:
            print(f"{head}{r['status']}: {r['reason']}")
            continue
        ratio = f"{r['ember_ratio']:.2f}x" if r["ember_ratio"] else ""
        train = f"{r['train_rss_mib']:,.0f}" if r["train_rss_mib"] else "n/a"
        print(f"{head}{r['params']:>12,}{r['tokens_per_s']:>11,.0f}{r['step_ms']:>10.1f}{train:>15}"
              f"{r['peak_rss_mib']:>14,.0f}{ratio:>12}" + (f"  ({r['reason']})" if r["reason"] else "")
              + (f"  (noisy: step times vary {r['step_spread']:.1f}x)" if r["noisy"] else ""))
