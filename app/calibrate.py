"""`genscore calibrate`: score a JSONL of prompts with gold labels against a served model and a label set, fit
temperature scaling (with per-label biases when they pay), report ECE and log loss before and after on a held-out
split, plot a reliability diagram, and write the calibration the server loads with --calibration."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.api.judge.calibration import Calibration, write_calibration
from app.api.judge.label_sets import read_label_sets
from app.calibration_fit import (
    ECE_BINS,
    Measures,
    apply,
    cross_validated_loss,
    fit,
    measures,
    reliability_bins,
    uncalibrated,
)


class CalibrateError(Exception):
    """Bad input or an unusable server answer: the command says why and exits 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="genscore calibrate",
        description="Fit the calibration of a named label set on labelled prompts scored by a running server.")
    p.add_argument("--data", type=Path, required=True,
                   help='JSONL, one {"query": prompt, "label": gold label} per line (the query as /score takes it)')
    p.add_argument("--label-set", required=True, help="name of the label set (as the server's --label-sets names it)")
    p.add_argument("--label-sets", type=Path,
                   help="the label-sets file; when given the set is sent inline, else by name to the server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--output", type=Path, required=True,
                   help="calibration file to write (an existing one keeps its other label sets)")
    p.add_argument("--plot", type=Path, help="reliability diagram PNG (needs matplotlib)")
    p.add_argument("--held-out", type=float, default=0.3, help="fraction of the examples kept out of the fit (0.3)")
    p.add_argument("--biases", choices=("auto", "on", "off"), default="auto",
                   help="per-label biases: auto keeps them when they lower the cross-validated log loss")
    p.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default="raw_logprobs")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (8)")
    p.add_argument("--scores", type=Path,
                   help="JSON file of the label logprobs: read instead of asking the server when it exists, else "
                        "written after scoring (to refit without scoring again)")
    return p


@dataclass(frozen=True)
class Example:
    query: str | list[int]
    gold: str


def read_examples(path: Path) -> list[Example]:
    examples = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CalibrateError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            examples.append(Example(row["query"], str(row["label"])))
        except (ValueError, KeyError, TypeError):
            raise CalibrateError(f"{path}:{number}: expected {{\"query\": ..., \"label\": ...}}") from None
    if len(examples) < 10:
        raise CalibrateError(f"{path} holds {len(examples)} examples; calibration needs at least 10")
    return examples


def score_all(args, labels_field, examples: list[Example]) -> tuple[list[str], list[list[float]], str]:
    """Each example's label logprobs from the server: (label names, [N][L] logprobs, the served model's name)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def one(client: httpx.Client, example: Example) -> dict:
        response = client.post("/score", json={"query": example.query, "labels": labels_field,
                                               "logprobs_mode": args.logprobs_mode})
        if response.status_code != 200:
            raise CalibrateError(f"the server answered {response.status_code}: {response.text}")
        return response.json()

    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        with ThreadPoolExecutor(args.concurrency) as pool:
            bodies = list(pool.map(lambda e: one(client, e), examples))
    names = [label["label"] for label in bodies[0]["data"][0]["labels"]]
    logprobs = [[-math.inf if lab["logprob"] == -9999.0 else lab["logprob"] for lab in body["data"][0]["labels"]]
                for body in bodies]
    return names, logprobs, bodies[0]["model"]


def split(n: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = max(1, round(n * held_out))
    return sorted(order[cut:]), sorted(order[:cut])


def plot(path: Path, before: list, after: list, title: str) -> None:
    """Two reliability diagrams side by side: accuracy per confidence bin against the diagonal."""
    try:
        import matplotlib
    except ImportError as exc:  # an optional dependency of the server: only the plot needs it
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    width = 1 / ECE_BINS
    for ax, (name, bins, measured) in zip(axes, (("uncalibrated", *before), ("calibrated", *after))):
        filled = [(i * width, c, a, n) for i, (c, a, n) in enumerate(bins) if n]
        lefts = [left for left, _, _, _ in filled]
        ax.bar(lefts, [a for _, _, a, _ in filled], width=width, align="edge", edgecolor="black", color="#4c72b0",
               label="accuracy")
        ax.bar(lefts, [abs(c - a) for _, c, a, _ in filled], bottom=[min(c, a) for _, c, a, _ in filled],
               width=width, align="edge", color="none", edgecolor="#c44e52", hatch="//", label="gap to confidence")
        for left, _, a, n in filled:
            ax.annotate(str(n), (left + width / 2, min(a, 0.93) + 0.02), ha="center", fontsize=7)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        ax.set_title(f"{name}: ECE {measured.ece:.3f}, log loss {measured.log_loss:.3f}", fontsize=10)
        ax.set_xlabel("confidence (top label's probability); n per bin")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate(args) -> int:
    examples = read_examples(args.data)
    labels_field: str | dict = args.label_set
    if args.label_sets is not None:
        try:
            sets = read_label_sets(args.label_sets)
        except ValueError as exc:
            raise CalibrateError(str(exc)) from None
        if args.label_set not in sets:
            raise CalibrateError(f"{args.label_sets} has no label set {args.label_set!r}")
        chosen = sets[args.label_set]
        labels_field = {label: list(forms) for label, forms in zip(chosen.labels, chosen.forms)}
    if args.scores is not None and args.scores.is_file():
        saved = json.loads(args.scores.read_text())
        names, logprobs, model = saved["labels"], saved["logprobs"], saved["model"]
        if len(logprobs) != len(examples):
            raise CalibrateError(f"{args.scores} holds {len(logprobs)} examples' scores, {args.data} {len(examples)}")
    else:
        names, logprobs, model = score_all(args, labels_field, examples)
        if args.scores is not None:
            args.scores.write_text(json.dumps({"labels": names, "logprobs": logprobs, "model": model}))
    unknown = sorted({e.gold for e in examples} - set(names))
    if unknown:
        raise CalibrateError(f"gold labels {unknown} are not labels of {args.label_set!r} ({names})")
    gold = [names.index(e.gold) for e in examples]
    fit_idx, held_idx = split(len(examples), args.held_out, args.seed)
    fit_z, fit_y = [logprobs[i] for i in fit_idx], [gold[i] for i in fit_idx]
    held_z, held_y = [logprobs[i] for i in held_idx], [gold[i] for i in held_idx]

    cv = {}
    if args.biases == "auto":
        cv = {b: cross_validated_loss(fit_z, fit_y, b, seed=args.seed) for b in (False, True)}
        with_biases = cv[True] < cv[False]
    else:
        with_biases = args.biases == "on"
    fitted = fit(fit_z, fit_y, with_biases)
    before_p, after_p = uncalibrated(held_z), apply(fitted, held_z)
    before, after = measures(before_p, held_y), measures(after_p, held_y)

    def row(m: Measures) -> dict:
        return {"ece": m.ece, "log_loss": m.log_loss, "accuracy": m.accuracy}

    report = {"examples": len(examples), "fit": len(fit_idx), "held_out": len(held_idx), "seed": args.seed,
              "biases": "on" if with_biases else "off", "held_out_before": row(before), "held_out_after": row(after)}
    if cv:
        report["cross_validated_log_loss"] = {"temperature": cv[False], "temperature_and_biases": cv[True]}
    calibration = Calibration(tuple(names), fitted.temperature, tuple(fitted.biases), args.logprobs_mode, model,
                              report)
    write_calibration(args.output, args.label_set, calibration)

    print(f"label set {args.label_set!r} on {model}: {len(fit_idx)} examples fitted, {len(held_idx)} held out")
    print(f"temperature {fitted.temperature:.4f}, biases "
          + ", ".join(f"{n} {b:+.4f}" for n, b in zip(names, fitted.biases))
          + (f" (cross-validated log loss {cv[True]:.4f} with biases, {cv[False]:.4f} without)" if cv else ""))
    print(f"{'held out':<14}{'ECE':>8}{'log loss':>10}{'accuracy':>10}")
    for name, m in (("uncalibrated", before), ("calibrated", after)):
        print(f"{name:<14}{m.ece:>8.4f}{m.log_loss:>10.4f}{m.accuracy:>10.4f}")
    print(f"wrote {args.output}")
    if args.plot is not None:
        plot(args.plot, (reliability_bins(before_p, held_y), before), (reliability_bins(after_p, held_y), after),
             f"{args.label_set} on {model}: {len(held_idx)} held-out examples")
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if not 0 < args.held_out < 1:
        print("genscore calibrate: --held-out must be between 0 and 1", file=sys.stderr)
        return 2
    try:
        return calibrate(args)
    except CalibrateError as exc:
        print(f"genscore calibrate: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"genscore calibrate: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
