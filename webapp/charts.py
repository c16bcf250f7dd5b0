"""Plotly figures of the dashboard, as plain dicts: pure functions of the data the selectors
read (no queries here), so a figure can be tested without a database."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from feedback.models import FeedbackEvent, Trajectory
    from training.models import TrainingRun

# mismatch_kl: engine mismatch on rows the run's base served; staleness_kl: rows an older version served
METRICS = ("loss", "kl_ref", "entropy", "clip_fraction", "mismatch_kl", "staleness_kl", "grad_norm", "reward_mean",
           "tokens_per_s")


def version_name(v: int | None) -> str:
    return "unknown version" if v is None else f"v{v}"


def run_figures(runs: list[tuple[TrainingRun, dict[str, list]]]) -> dict[str, Any]:
    figures = {}
    for name in METRICS:
        data = [{"type": "scatter", "mode": "lines", "name": f"run {run.id}", "x": c["step"], "y": c[name]}
                for run, c in runs]
        figures[name] = {"data": data, "layout": {"title": {"text": name}, "margin": {"t": 40, "r": 10, "l": 50},
                                                   "xaxis": {"title": {"text": "step"}}, "showlegend": len(runs) > 1,
                                                   "legend": {"orientation": "h"}}}
    return figures


def _quantile(bins: dict[int, int], q: float) -> float:
    """Quantile of a 10-bin histogram over [0, 1], linear inside the bin."""
    total = sum(bins.values())
    target, seen = q * total, 0
    for b in range(10):
        n = bins.get(b, 0)
        if n and seen + n >= target:
            return round((b + (target - seen) / n) / 10, 4)
        seen += n
    return 1.0


def rubric_figures(hist: dict[tuple, dict[int, int]], sums: dict[tuple, float], agree: list[dict]) -> dict:
    aspects = sorted({k[1] for k in hist})
    versions = sorted({k[0] for k in hist if k[0] is not None})
    boxes = []
    for aspect in aspects:
        keys = [(v, aspect, "judge") for v in versions if hist.get((v, aspect, "judge"))]
        scored = [(k, {b: n for b, n in hist[k].items() if b >= 0}) for k in keys]
        scored = [(k, h) for k, h in scored if sum(h.values())]
        if not scored:
            continue
        boxes.append({
            "type": "box", "name": aspect, "x": [f"v{k[0]}" for k, _ in scored],
            "q1": [_quantile(h, 0.25) for _, h in scored], "median": [_quantile(h, 0.5) for _, h in scored],
            "q3": [_quantile(h, 0.75) for _, h in scored], "lowerfence": [_quantile(h, 0.0) for _, h in scored],
            "upperfence": [_quantile(h, 1.0) for _, h in scored],
            "mean": [round(sums[k] / sum(h.values()), 4) for k, h in scored],
        })
    dists = []
    for aspect in aspects:
        for source in ("judge", "human"):
            counts = [sum(h.get(b, 0) for k, h in hist.items() if k[1] == aspect and k[2] == source) for b in range(10)]
            if sum(counts):
                dists.append({"type": "bar", "name": f"{aspect} · {source}", "x": [f"{b / 10:.1f}" for b in range(10)],
                              "y": counts})
    margin = {"t": 40, "r": 10, "l": 40}
    return {
        "boxes": {"data": boxes, "layout": {"title": {"text": "Judge score per aspect per version"}, "boxmode": "group",
                                            "yaxis": {"range": [0, 1]}, "margin": margin, "legend": {"orientation": "h"}}},
        "dists": {"data": dists, "layout": {"title": {"text": "Score distributions"}, "barmode": "group",
                                            "margin": margin, "legend": {"orientation": "h"}}},
        "agreement": {"data": [{"type": "bar", "x": [a["aspect"] for a in agree], "y": [a["rate"] for a in agree],
                                "name": "agreement"}],
                      "layout": {"title": {"text": "Judge vs human agreement (|Δ| ≤ 0.2)"}, "yaxis": {"range": [0, 1]},
                                 "margin": margin}},
    }


def token_colour(logprob: float | None) -> str:
    if logprob is None:
        return "transparent"
    p = math.exp(max(min(logprob, 0.0), -20.0))
    return f"hsl({round(120 * p)}, 75%, 82%)"


def routing_figure(routing: Any, n_tokens: int, max_positions: int | None = None) -> dict[str, Any] | None:
    """Heatmap of the top-1 expert per layer (rows) per position (columns); hover shows the top-k.
    Past `max_positions` tokens only the first ones are drawn (the title says so)."""
    if not isinstance(routing, list) or not routing or not isinstance(routing[0], list):
        return None
    positions = routing[-n_tokens:] if n_tokens else routing
    total = len(positions)
    positions = positions[:max_positions] if max_positions else positions
    title = "MoE routing (top-1 expert)" + (f", first {len(positions)} of {total} tokens" if len(positions) < total else "")
    layers = max(len(p) for p in positions)
    z = [[(p[layer][0] if layer < len(p) and p[layer] else None) for p in positions] for layer in range(layers)]
    text = [[str(p[layer]) if layer < len(p) else "" for p in positions] for layer in range(layers)]
    return {"data": [{"type": "heatmap", "z": z, "text": text, "hovertemplate": "pos %{x} layer %{y}: %{text}",
                      "colorscale": "Viridis", "colorbar": {"title": {"text": "expert"}}}],
            "layout": {"title": {"text": title}, "margin": {"t": 40, "r": 10, "l": 40},
                       "xaxis": {"title": {"text": "token"}}, "yaxis": {"title": {"text": "layer"}}}}


def timeline_figure(t: Trajectory, feedback: list[FeedbackEvent]) -> dict[str, Any]:
    data = [{"type": "scatter", "mode": "markers", "name": "trajectory", "x": [t.occurred_at.isoformat()],
             "y": ["trajectory"], "marker": {"size": 12, "symbol": "diamond"}},
            {"type": "scatter", "mode": "markers", "name": "feedback", "x": [f.occurred_at.isoformat() for f in feedback],
             "y": [f.signal for f in feedback], "marker": {"size": 10}}]
    return {"data": data, "layout": {"title": {"text": "Feedback timeline"}, "showlegend": False, "height": 260,
                                     "margin": {"t": 40, "r": 10, "l": 90}}}


def _by_version(keys: Any) -> list:
    return sorted(keys, key=lambda v: (v is None, v or 0))


def overview_figures(feedback: dict[str, Any], rewards: dict[int | None, dict[str, list]],
                     marks: list[tuple[str, str]], cut: Any) -> dict[str, Any]:
    """Volume, accept/happy rate and reward per version over time, with a dotted line (and the
    version's name) where each promotion happened; minute buckets after `cut`, hourly before."""
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
               "line": {"dash": "dot", "width": 1, "color": "#888"}} for x, _ in marks]
    notes = [{"x": x, "y": 1, "xref": "x", "yref": "paper", "text": f"{name} promoted", "showarrow": False,
              "yanchor": "bottom", "font": {"size": 10}} for x, name in marks]
    series = feedback["by_version"]
    order = _by_version(series)

    def layout(title: str, **extra: Any) -> dict[str, Any]:
        return {"title": {"text": title}, "shapes": shapes, "annotations": notes, "margin": {"t": 40, "r": 10, "l": 40},
                "legend": {"orientation": "h"}, "hovermode": "x unified", **extra}

    volume = [{"type": "bar", "name": version_name(v), "x": series[v]["x"], "y": series[v]["n"]} for v in order]
    volume.append({"type": "scatter", "mode": "markers", "name": "live (this page)", "x": [], "y": [],
                   "marker": {"color": "#d62828", "size": 9}})
    rate = [{"type": "scatter", "mode": "lines+markers", "name": version_name(v), "x": series[v]["x"],
             "y": series[v]["rate"], "connectgaps": False} for v in order]
    reward = [{"type": "scatter", "mode": "lines+markers", "name": version_name(v), "x": rewards[v]["x"],
               "y": rewards[v]["reward"]} for v in _by_version(rewards)]
    buckets = f"per minute since {cut:%H:%M}, per hour before"
    return {
        "totals": {"feedback": feedback["total"], "rate": feedback["rate"],
                   "trajectories": sum(sum(s["trajectories"]) for s in rewards.values())},
        "figures": {
            "volume": {"data": volume, "layout": layout(f"Feedback ({buckets})", barmode="stack")},
            "rate": {"data": rate, "layout": layout(f"Happy/accept rate per version ({buckets})",
                                                    yaxis={"range": [0, 1]})},
            "reward": {"data": reward, "layout": layout(f"Reward mean per version ({buckets})")},
        },
    }
