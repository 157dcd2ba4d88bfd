"""The sweeps, table, CSV and figure of docs/communication.md's "Fewer bytes" section (issue 51), run by
sweeps/communication/run_codes.sh:

    python sweeps/communication/codes.py plan     # the seed-1 grids: sweeps/communication/codes/*.yaml
    python sweeps/communication/codes.py seeds    # seeds 2-3 (and the state_every cells) at each chosen rate
    python sweeps/communication/codes.py edges    # the next rate out where a cell's chosen rate is its grid's edge
    python sweeps/communication/codes.py tune     # the state cells' rates: seed 1 either side, then seeds 2-3
    python sweeps/communication/codes.py          # docs/communication/codes.csv, the tables, codes.png

A cell is (setting, method, code, state period, error feedback). Its rate is chosen on the training objective,
never a test metric: MNIST's f(x_R) (``train_objective``), the language model's ``train_loss`` (the machines'
loss over the last two rounds). Where a cell's trials stack (SLowcal-SGD and Adaptive SLowcal on MNIST), its
three rates run with seeds 1-3 and the seeds' mean picks (as docs/adaptive.md's MNIST grid); elsewhere seed 1's
three rates pick and seeds 2-3 run at that rate (as its language-model grid). The rates are each method's tuned
rate (docs/adaptive.md, docs/table1_tuned.csv, docs/time_to_accuracy.md) and its two neighbours on the project's
10^(1/3) grid. A state_every cell trains at its code's chosen rate with state_every = 1; so do the cells of Local-SGD with AdamW and
DiLoCo with AdamW's moments averaged (``--average_state``, every round and every 4th: DES-LOC), methods of their own
here (``*_moments``); ``tune`` then runs seed 1 at the two rates either side of that rate, and seeds 2-3 where seed 1
chose another. Every cell is tuned, every code runs in every setting. Where a cell's chosen rate is the lowest
or highest it searched, ``edges`` writes the grid's next rate out (with the seeds its other rates ran), once; a cell
still at its edge after that says so in the table's "edge" column; once ``tune`` has searched a state cell's three
rates, ``edges`` steps it out the same way.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "sweeps" / "communication" / "codes"
RESULTS = ROOT / "sweeps" / "results" / "communication_codes.jsonl"
DOCS = ROOT / "docs" / "communication"
_spec = importlib.util.spec_from_file_location("adaptive_figures", ROOT / "sweeps" / "adaptive" / "figures.py")
adaptive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(adaptive)  # method_of, choose, mean, LABELS, COLORS: the adaptive study's, reused

GRID = [0.0000464, 0.0001, 0.000215, 0.000464, 0.001, 0.00215, 0.00464, 0.01, 0.0215, 0.0464, 0.1, 0.215, 0.464, 1.0,
        2.15, 4.64]  # fmt: skip
CODES = ["null", "int8", "int4", "int2", "topk:0.01:2", "topk:0.03:2"]
SPARSE = ["int2", "topk:0.01:2", "topk:0.03:2"]  # the codes also run without error feedback, on NO_EF
NO_EF = "mnist64"
STATE_EVERY = 4
MNIST = ["configs/paper.yaml", "--model.weight_decay=1e-4", "--eval_every=1000000", "--diagnostics=false"]
LM = ["configs/charlm.yaml", "--trainer.log_every_n_steps=2", "--trainer.max_epochs=1", "--eval_every=1000000"]
SETTINGS = {  # name: (M, K, config arguments, criterion, metric)
    "mnist16": (16, 16, MNIST, "train_objective", "test_acc"),
    "mnist64": (64, 64, MNIST, "train_objective", "test_acc"),
    "lm16": (8, 16, LM, "train_loss", "test_bpc"),
    "lm64": (8, 64, LM, "train_loss", "test_bpc"),
}
CENTRE = {  # (setting, method): the tuned float32 rate the grid is centred on
    ("mnist16", "slowcal"): 0.0215, ("mnist64", "slowcal"): 0.0464,
    ("mnist16", "adaptive_slowcal"): 0.000464, ("mnist64", "adaptive_slowcal"): 0.00464,
    ("mnist16", "local_adamw"): 0.000464, ("mnist64", "local_adamw"): 0.000464,
    ("mnist16", "diloco"): 0.0001, ("mnist64", "diloco"): 0.001,
    ("lm16", "slowcal"): 2.15, ("lm64", "slowcal"): 2.15,
    ("lm16", "adaptive_slowcal"): 0.0464, ("lm64", "adaptive_slowcal"): 0.0215,
    ("lm16", "local_adamw"): 0.01, ("lm64", "local_adamw"): 0.01,
    ("lm16", "diloco"): 0.01, ("lm64", "diloco"): 0.01,
}  # fmt: skip
MARKERS = {"float32": "o", "int8": "s", "int4": "^", "int2": "v", "topk:0.01:2": "X", "topk:0.03:2": "P"}
STACKED = ("slowcal", "adaptive_slowcal")  # MNIST trials that train stacked (diloco's server step does not)
METHODS = ("slowcal", "adaptive_slowcal", "local_adamw", "diloco", "local_adamw_moments", "diloco_moments")
LABELS = {"slowcal": "SLowcal-SGD", "adaptive_slowcal": "Adaptive SLowcal", "local_adamw": "Local-SGD with AdamW",
          "diloco": "DiLoCo", "local_adamw_moments": "Local-SGD with AdamW, moments averaged",
          "diloco_moments": "DiLoCo, moments averaged"}  # fmt: skip
COLORS = {**adaptive.COLORS, "local_adamw_moments": "tab:brown", "diloco_moments": "tab:green"}
#: AdamW's moments averaged with the model (``--average_state``), every round or every STATE_EVERY-th (DES-LOC):
#: a method of its own here, at its plain method's chosen rate.
MOMENTS = "exp_avg,exp_avg_sq"
EVERY_CODE = ["float32", *CODES[1:]]
#: (setting, codes, seeds): where the state goes on its own period (the SLowcal methods' w or declared state every
#: STATE_EVERY-th round; AdamW's moments averaged every round and every STATE_EVERY-th), at each code's chosen rate.
STATE_CELLS = (
    ("mnist16", EVERY_CODE, [1, 2, 3]), ("mnist64", EVERY_CODE, [1, 2, 3]),
    ("lm16", EVERY_CODE, [1, 2, 3]), ("lm64", EVERY_CODE, [1, 2, 3]),
)  # fmt: skip


def plain(method: str) -> str:
    """The method a ``*_moments`` method averages the moments of (its rate is that method's)."""
    return method.removesuffix("_moments")


def method_of(record: dict) -> str:
    """The adaptive study's method name, ``_moments`` added where AdamW's moments are averaged."""
    return adaptive.method_of(record) + ("_moments" if record["params"].get("average_state") else "")


def slug(code: str) -> str:
    """A code as a sweep file's name has it (``topk:0.01:2``: ``topk_001_2``)."""
    return code.replace(":", "_").replace(".", "")


def flag(code: str) -> str:
    """A code as ``--compression`` takes it (float32: ``null``)."""
    return "null" if code == "float32" else code


def nearest(lr: float) -> int:
    """The index of the grid's rate nearest ``lr``."""
    return min(range(len(GRID)), key=lambda j: abs(math.log(GRID[j] / lr)))


def rates(setting: str, method: str) -> list[float]:
    i = nearest(CENTRE[setting, method])
    return GRID[i - 1 : i + 2]


def write_sweep(name: str, note: str, setting: str, method: str, params: dict) -> Path:
    """A grid sweep file of ``setting`` and ``method`` with ``params`` (name: list of values)."""
    M, K, config, criterion, _ = SETTINGS[setting]
    named = plain(method)
    base = {"method": ["diloco" if named == "local_adamw" else named], "num_machines": [M], "local_steps": [K]}
    if named == "local_adamw":
        base["model.outer"] = ["none"]
    if method != named:
        base["average_state"] = [MOMENTS]
    lines = [f"# {line}" for line in note.splitlines()] + [
        "#   sweeps/communication/run_codes.sh",
        f"name: codes-{name}",
        f"description: 'fewer bytes (issue 51): {name}'",
        "project: lit_slowcal",
        "program: lit_slowcal/__main__.py",
        "method: grid",
        f"metric: {{name: {criterion}, goal: minimize}}",
        "parameters:",
    ]
    for key, values in {**base, **params}.items():
        shown = ", ".join(
            json.dumps(v) if isinstance(v, str) and (":" in v or "," in v or v == "null") else str(v) for v in values
        )
        lines.append(f"  {key}: {{values: [{shown}]}}")
    command = ["'${env}'", "python", "-m", "lit_slowcal", "fit", "--config", *config, "'${args}'"]
    lines.append(f"command: [{', '.join(command)}]")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return path


def plan() -> None:
    """The seed-1 grids (seeds 1-3 where the trials stack), error feedback on; then off for the sparse codes."""
    for setting in SETTINGS:
        lm = setting.startswith("lm")
        for method in METHODS[:4]:
            stacked = not lm and method in STACKED
            seeds = [1, 2, 3] if stacked else [1]
            what = "seeds 1-3 (stacked)" if stacked else "seed 1"
            common = {"seed_everything": seeds, "model.lr": rates(setting, method)}
            write_sweep(
                f"{setting}_{method}", f"{LABELS[method]}, {setting}: every code, {what}, error feedback on.",
                setting, method, {**common, "compression": CODES},
            )  # fmt: skip
            if setting == NO_EF:
                write_sweep(
                    f"{setting}_{method}_noef", f"{LABELS[method]}, {setting}: the sparse codes without error feedback.",
                    setting, method, {**common, "compression": SPARSE, "error_feedback": ["false"]},
                )  # fmt: skip


def code_of(params: dict) -> str:
    comp = params.get("compression", "null")
    return "float32" if comp in (None, "null") else str(comp)


def setting_of(params: dict) -> str:
    M, K = int(params["num_machines"]), int(params["local_steps"])
    return next(s for s, v in SETTINGS.items() if v[:2] == (M, K) and (s.startswith("lm") == (M == 8)))


def load(path: Path = RESULTS) -> dict[tuple, dict[float, dict[int, dict]]]:
    """(setting, method, code, state period, error feedback) -> lr -> seed -> metrics (failed: empty)."""
    cells: dict[tuple, dict[float, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    if not path.exists():
        return cells
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            p = r["params"]
            ef = str(p.get("error_feedback", "true")).lower() != "false"
            method = method_of(r)
            if method in ("local_adamw", "diloco") and int(p.get("state_every", 1)) != 1:
                continue  # without averaged moments an AdamW run has no state to put on a period: the same run
            key = (setting_of(p), method, code_of(p), int(p.get("state_every", 1)), ef)
            metrics = r["metrics"] if r["status"] == "finished" else {"error": r.get("error")}
            cells[key][float(p["model.lr"])][int(p["seed_everything"])] = metrics
    return cells


def chosen(cells: dict, key: tuple) -> float:
    """The cell's rate: by seeds 1-3's mean where every rate ran them, else by seed 1."""
    grid = cells[key]
    everywhere = [s for s in (1, 2, 3) if all(s in runs for runs in grid.values())]
    criterion = SETTINGS[key[0]][3]
    return adaptive.choose(grid, criterion, tuple(everywhere or [1]))["lr"]


def seeds() -> None:
    """Seeds 2-3 at each seed-1-tuned cell's rate; the state_every cells (seeds 1-3) at their code's rate."""
    cells = load()
    for key in sorted(cells):
        setting, method, code, state, ef = key
        if state != 1 or not ef or method != plain(method) or 2 in cells[key][chosen(cells, key)]:
            continue
        lr = chosen(cells, key)
        name = f"{setting}_{method}_{slug(code)}_seeds"
        write_sweep(
            name,
            f"{LABELS[method]}, {setting}, {code}: seeds 2-3 at the seed-1 rate.",
            setting,
            method,
            {"seed_everything": [2, 3], "model.lr": [lr], "compression": [flag(code)]},
        )
    for setting, codes, seeds_ in STATE_CELLS:
        for method in METHODS[:2]:
            for code in codes:
                key = (setting, method, code, 1, True)
                if key not in cells:
                    continue
                lr = chosen(cells, key)
                name = f"{setting}_{method}_{slug(code)}_state{STATE_EVERY}"
                write_sweep(
                    name, f"{LABELS[method]}, {setting}, {code}: the state every {STATE_EVERY} rounds.", setting, method,
                    {"seed_everything": seeds_, "model.lr": [lr], "compression": [flag(code)],
                     "state_every": [STATE_EVERY]},
                )  # fmt: skip
    for setting, codes, seeds_ in STATE_CELLS:  # AdamW's moments averaged, every round and every STATE_EVERY-th
        for method in ("local_adamw", "diloco"):
            for code in codes:
                key = (setting, method, code, 1, True)
                if key not in cells:
                    continue
                name = f"{setting}_{method}_moments_{slug(code)}"
                write_sweep(
                    name, f"{LABELS[method]}, {setting}, {code}: AdamW's moments averaged every round and every "
                    f"{STATE_EVERY}-th (DES-LOC), at the rate chosen without them.", setting, f"{method}_moments",
                    {"seed_everything": seeds_, "model.lr": [chosen(cells, key)],
                     "compression": [flag(code)], "state_every": [1, STATE_EVERY]},
                )  # fmt: skip


def state_cells(cells: dict) -> list[tuple[tuple, str, dict]]:
    """Each state cell that ran (``STATE_CELLS``: the SLowcal methods' state every ``STATE_EVERY``-th round, AdamW's
    moments averaged) as (its key, its sweep files' stem, the parameters besides the rate and seeds that make it)."""
    out = []
    for setting, codes, _ in STATE_CELLS:
        for code in codes:
            for method in METHODS[:2]:
                key = (setting, method, code, STATE_EVERY, True)
                if key in cells:
                    out.append((key, f"{setting}_{method}_{slug(code)}_state{STATE_EVERY}",
                                {"compression": [flag(code)], "state_every": [STATE_EVERY]}))  # fmt: skip
            for method in ("local_adamw_moments", "diloco_moments"):
                for state in (1, STATE_EVERY):
                    key = (setting, method, code, state, True)
                    if key in cells:
                        out.append((key, f"{setting}_{method}_{slug(code)}_every{state}",
                                    {"compression": [flag(code)], "state_every": [state]}))  # fmt: skip
    return out


def tune(path: Path = RESULTS) -> None:
    """The state cells tuned as their plain cells were: at the grid's two rates either side of the rate they ran
    (their plain cell's), once (``*_rates``), seeds 1-3 where the trials stack (the SLowcal methods on MNIST: the
    seeds' mean picks), else seed 1; then, where seed 1 chose another rate, seeds 2-3 there (``*_rates_seeds``).
    Their table rows then give the rate they chose."""
    cells = load(path)
    for key, stem, params in state_cells(cells):
        setting, method = key[0], key[1]
        ran = sorted(cells[key])
        if len(ran) == 1:
            i = nearest(ran[0])
            around = [GRID[j] for j in (i - 1, i + 1) if 0 <= j < len(GRID)]
            stacked = not setting.startswith("lm") and method in STACKED
            if not (OUT / f"{stem}_rates.yaml").exists():
                write_sweep(
                    f"{stem}_rates", f"{LABELS[method]}, {setting}, {key[2]}, state every {key[3]}: "
                    f"{'seeds 1-3' if stacked else 'seed 1'} at the rates either side of {ran[0]:g}, the rate its plain "
                    "cell chose.", setting, method,
                    {"seed_everything": [1, 2, 3] if stacked else [1], "model.lr": around, **params},
                )  # fmt: skip
            continue
        lr = chosen(cells, key)
        if 2 not in cells[key][lr]:
            stepped = len(ran) > 3 and lr in (ran[0], ran[-1])  # the rate ``edges`` added: its own file
            write_sweep(
                f"{stem}_{'edge' if stepped else 'rates'}_seeds", f"{LABELS[method]}, {setting}, {key[2]}, state every "
                f"{key[3]}: seeds 2-3 at {lr:g}, the rate seed 1 chose.", setting, method,
                {"seed_everything": [2, 3], "model.lr": [lr], **params},
            )  # fmt: skip


def edges(path: Path = RESULTS) -> None:
    """Where a tuned cell's chosen rate is the lowest or highest it searched, the grid's next rate out, at the seeds
    its other rates ran (one step: a cell's edge sweep is written once). The plain cells and, once ``tune`` searched
    their three rates, the state cells alike."""
    cells = load(path)
    plain_cells = []
    for key in sorted(cells):
        setting, method, code, state, ef = key
        if state == 1 and method == plain(method):
            params = {"compression": [flag(code)]} | ({} if ef else {"error_feedback": ["false"]})
            plain_cells.append((key, f"{setting}_{method}_{slug(code)}{'' if ef else '_noef'}", params))
    for key, stem, params in [*plain_cells, *state_cells(cells)]:
        setting, method, code, state, ef = key
        if len(cells[key]) < 2:
            continue
        searched, lr = sorted(cells[key]), chosen(cells, key)
        i = nearest(lr)
        step = -1 if lr == searched[0] else 1 if lr == searched[-1] else 0
        name = f"{stem}_edge"
        if not step or not 0 <= i + step < len(GRID) or (OUT / f"{name}.yaml").exists():
            continue
        seeds_ = sorted(set.intersection(*(set(runs) for runs in cells[key].values())))
        what = "" if ef else ", no error feedback"
        what += f", state every {state}" if method in METHODS[:2] and state != 1 else ""
        what += f", moments every {state}" if method != plain(method) else ""
        write_sweep(
            name, f"{LABELS[method]}, {setting}, {code}{what}: its chosen rate {lr:g} was the "
            f"{'lowest' if step < 0 else 'highest'} searched, so the grid's next rate out.", setting, method,
            {"seed_everything": seeds_, "model.lr": [GRID[i + step]], **params},
        )  # fmt: skip


def rows(path: Path = RESULTS) -> list[dict]:
    """One row per cell at its chosen rate: the seeds' metric and what a machine sent (means, sample std)."""
    cells, out = load(path), []
    for key in sorted(cells, key=lambda k: (list(SETTINGS).index(k[0]), METHODS.index(k[1]), k[3], not k[4], k[2])):
        setting, method, code, state, ef = key
        lr = chosen(cells, key)  # a state cell not yet tuned (``tune``) ran its plain cell's rate alone
        runs = cells[key][lr]
        metric = SETTINGS[setting][4]
        values = [runs[s].get(metric, math.inf) for s in sorted(runs)]
        sent = [runs[s].get("ring_bytes_per_machine", math.nan) for s in sorted(runs)]
        searched = sorted(cells[key])
        edge = "only" if len(searched) == 1 else "low" if lr == searched[0] else "high" if lr == searched[-1] else "no"
        out.append({
            "setting": setting, "method": method, "code": code, "state_every": state, "error_feedback": ef,
            "lr": lr, "lr_at_edge": edge, "seeds": len(values), "metric": metric, "mean": adaptive.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 and all(map(math.isfinite, values)) else 0.0,
            "bytes_per_machine": statistics.fmean(sent),
            "errors": sorted({str(runs[s]["error"]) for s in runs if runs[s].get("error")}),
        })  # fmt: skip
    for r in out:
        base = [b for b in out if (b["setting"], b["method"], b["code"], b["state_every"], b["error_feedback"])
                == (r["setting"], r["method"], "float32", 1, True)]  # fmt: skip
        r["x_float32_bytes"] = r["bytes_per_machine"] / base[0]["bytes_per_machine"] if base else math.nan
    return out


def better(metric: str, a: float, b: float) -> bool:
    """``a`` at least as good as ``b`` (accuracy: higher; bits per character: lower)."""
    return a >= b if metric.endswith("acc") else a <= b


TOLERANCE = {"test_acc": 0.001, "test_bpc": 0.01}  # a target: a float32 mean, less 0.1 points / plus 0.01 bpc


def targets(found: list[dict], setting: str) -> list[tuple[str, float]]:
    """The setting's targets, each a float32 cell's mean within ``TOLERANCE`` (the seeds spread by about as much):
    float32 Local-SGD with AdamW's, and the best float32 method's where that is another."""
    f32 = {r["method"]: r for r in found if r["setting"] == setting and r["code"] == "float32"
           and r["state_every"] == 1 and r["error_feedback"]}  # fmt: skip
    out = []

    def target(r: dict) -> float:
        return r["mean"] + (-1 if r["metric"].endswith("acc") else 1) * TOLERANCE[r["metric"]]

    if "local_adamw" in f32:
        out.append(("float32 Local-SGD with AdamW", target(f32["local_adamw"])))
    if f32:
        best = max(f32.values(), key=lambda r: r["mean"] if r["metric"].endswith("acc") else -r["mean"])
        if not out or best["method"] != "local_adamw":
            out.append((f"float32 {LABELS[best['method']]}", target(best)))
    return out


def cheapest(found: list[dict], setting: str, target: float) -> list[dict]:
    """The cells of ``setting`` (error feedback on) whose seeds' mean reaches ``target``, fewest bytes first."""
    ok = [r for r in found if r["setting"] == setting and r["error_feedback"] and math.isfinite(r["mean"])
          and better(r["metric"], r["mean"], target)]  # fmt: skip
    return sorted(ok, key=lambda r: r["bytes_per_machine"])


def describe(r: dict) -> str:
    state = f", state every {r['state_every']}" if r["state_every"] != 1 else ""
    ef = "" if r["error_feedback"] else ", no EF"
    return f"{LABELS[r['method']]} {r['code']}{state}{ef}"


def table(found: list[dict], setting: str) -> list[str]:
    lines = [
        "| method | code | state every | EF | rate | edge | seeds | metric, mean ± std | MB a machine | x float32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in found if r["setting"] == setting):
        lines.append(
            f"| {LABELS[r['method']]} | {r['code']} | {r['state_every']} | {'on' if r['error_feedback'] else 'off'} | "
            f"{r['lr']:g} | {r['lr_at_edge']} | {r['seeds']} | {r['mean']:.4f} ± {r['std']:.4f} | "
            f"{r['bytes_per_machine'] / 1e6:.3f} | {r['x_float32_bytes']:.3f} |"
        )
    return lines


def write_csv(found: list[dict], path: Path) -> None:
    header = ["setting", "method", "code", "state_every", "error_feedback", "lr", "lr_at_edge", "seeds", "metric",
              "mean", "std", "bytes_per_machine", "x_float32_bytes"]  # fmt: skip
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in found:
            w.writerow([r[h] for h in header])


def figure(found: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in SETTINGS if any(r["setting"] == s for r in found)]
    fig, grid = plt.subplots(2, 2, figsize=(11, 10), squeeze=False)
    axes = [list(grid.flat)]
    for ax, setting in zip(axes[0], shown):
        M, K, _, _, metric = SETTINGS[setting]
        for method in METHODS:
            color = COLORS[method]
            for state, ef, style, fill in (
                (1, True, "-", True),
                (STATE_EVERY, True, "--", False),
                (1, False, ":", False),
            ):
                rs = sorted((r for r in found if (r["setting"], r["method"], r["state_every"], r["error_feedback"])
                             == (setting, method, state, ef) and math.isfinite(r["mean"])),
                            key=lambda r: r["bytes_per_machine"])  # fmt: skip
                if not rs:
                    continue
                for r in rs:
                    ax.errorbar(r["bytes_per_machine"] / 1e6, r["mean"], yerr=r["std"], color=color, capsize=2,
                                marker=MARKERS.get(r["code"], "*"), ms=6, mfc=color if fill else "none", ls="none")  # fmt: skip
                frontier, best = [], None  # the best metric at no more bytes: the method's line
                for r in rs:
                    if best is None or better(metric, r["mean"], best):
                        best = r["mean"]
                        frontier.append(r)
                label = LABELS[method] + ("" if state == 1 else f", state every {state}") + ("" if ef else ", no EF")
                ax.plot([r["bytes_per_machine"] / 1e6 for r in frontier], [r["mean"] for r in frontier], color=color,
                        ls=style, label=label)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("MB a machine sent (ring)")
        ax.set_ylabel({"test_acc": "test accuracy", "test_bpc": "test bits per character"}[metric])
        name = "MNIST" if setting.startswith("mnist") else "language model"
        ax.set_title(f"{name}, M = {M}, K = {K}", fontsize=10)
        ax.grid(True, alpha=0.3)
        if metric == "test_bpc":  # a diverging run's bpc (up to 2e5) is off the scale: the table has it
            ax.set_ylim(2.2, 6.5)
        elif setting == "mnist16":  # AdamW's moments coded at 2 bits blow up (0.04-0.18): the table has them
            ax.set_ylim(0.7, 0.93)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="grey", marker=m, ls="none", label=c) for c, m in MARKERS.items()]
    labels = [h.get_label() for h in handles]
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Final metric against what a machine sent: float32, int8, int4, int2, TopK 1 % / 3 % at 2 bits\n"
                 "(each point a code at its tuned rate, mean ± std over the seeds; a line: the best so far at no more bytes;\n"
                 "hollow: no error feedback (dotted) or the state every 4 rounds (dashed))", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.13, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def target_table(found: list[dict]) -> list[str]:
    """Per setting and target: the cell of fewest bytes whose seeds' mean reaches it, and another method's."""
    lines = [
        "| setting | target | value | fewest bytes | MB a machine | mean ± std (seeds) | another method's fewest |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        M, K = SETTINGS[setting][:2]
        name = f"{'MNIST' if setting.startswith('mnist') else 'LM'} M = {M}, K = {K}"
        for what, target in targets(found, setting):
            first = cheapest(found, setting, target)
            if not first:
                lines.append(f"| {name} | {what} | {target:.4f} | none | | | |")
                continue
            r = first[0]
            after = next((o for o in first if o["method"] != r["method"]), None)  # another method's cheapest
            following = (
                f"{describe(after)}, {after['bytes_per_machine'] / 1e6:.3f} MB, {after['mean']:.4f}" if after else ""
            )
            lines.append(
                f"| {name} | {what} | {target:.4f} | {describe(r)} | {r['bytes_per_machine'] / 1e6:.3f} | "
                f"{r['mean']:.4f} ± {r['std']:.4f} ({r['seeds']}) | {following} |"
            )
    return lines


def report() -> None:
    found = rows()
    DOCS.mkdir(parents=True, exist_ok=True)
    write_csv(found, DOCS / "codes.csv")
    figure(found, DOCS / "codes.png")
    for setting in SETTINGS:
        if not any(r["setting"] == setting for r in found):
            continue
        print(f"\n{setting}\n" + "\n".join(table(found, setting)))
        for name, target in targets(found, setting):
            first = cheapest(found, setting, target)
            where = ", ".join(f"{describe(r)} ({r['bytes_per_machine'] / 1e6:.3f} MB, {r['mean']:.4f} ± {r['std']:.4f},"
                              f" {r['seeds']} seeds)" for r in first[:3])  # fmt: skip
            print(f"target {name} = {target:.4f}: {where or 'none'}")
    print("\n" + "\n".join(target_table(found)))
    for r in found:
        if r["errors"]:
            print(f"failed: {describe(r)} {r['setting']}: {r['errors']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="report", choices=["plan", "seeds", "edges", "tune", "report"])
    args = parser.parse_args()
    if args.what == "plan":
        plan()
    elif args.what == "seeds":
        seeds()
    elif args.what == "edges":
        edges()
    elif args.what == "tune":
        tune()
    else:
        report()


if __name__ == "__main__":
    sys.exit(main())
