"""AdaptiveSlowcal's two design choices, measured on the language model (docs/adaptive.md, "Design").

The character transformer of ``configs/charlm.yaml`` (M = 8, K = 16, b = 8), one epoch (66 rounds), seed 1,
at two learning rates, in four variants:

* ``per_machine``: the shipped default: v stays on each machine, the step clock runs on across syncs;
* ``averaged_v``: a synchronisation averages v too (``--model.average_second_moment=true``, 3d floats a round);
* ``restart_clock``: after every synchronisation each machine's clock starts again (t = 0: the averaging
  weights and the bias correction restart; x becomes mostly w again);
* ``reset_v``: v is zeroed at every synchronisation (a fresh second moment each round, as if not kept).

Prints one line per run: the variant, the rate, the final test bits per character and train loss.

    python benchmarks/adaptive_design.py [--lrs 0.003 0.01] [--epochs 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lit_slowcal.adaptive import AdaptiveSlowcal  # noqa: E402

VARIANTS = ("per_machine", "averaged_v", "restart_clock", "reset_v")


def _post_sync(variant: str):
    shipped = AdaptiveSlowcal._query_point_of_averages

    def post_sync(self: AdaptiveSlowcal) -> None:
        shipped(self)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                if variant == "restart_clock":
                    state["step"], state["alpha_sum"], state["alpha_sum_error"] = 0, 1.0, 0.0
                    state["w"].copy_(p)  # a fresh start from the averaged x: w_0 = x_0
                elif variant == "reset_v":
                    state["v"].zero_()

    return post_sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.01])
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    from lit_slowcal.experiments import sweep as sw

    shipped = AdaptiveSlowcal._query_point_of_averages
    for variant in VARIANTS:
        for lr in args.lrs:
            AdaptiveSlowcal._query_point_of_averages = (
                shipped if variant in ("per_machine", "averaged_v") else _post_sync(variant)
            )
            extra = ["--model.average_second_moment=true"] if variant == "averaged_v" else []
            start = time.perf_counter()
            outcome = sw.run_trial(
                ["fit", "--config", "configs/charlm.yaml", f"--model.lr={lr}", f"--trainer.max_epochs={args.epochs}",
                 "--run_dir=/tmp/adaptive_design", *extra]
            )  # fmt: skip
            m = outcome["metrics"]
            print(
                f"{variant:14s} lr {lr:<7g} test_bpc {m.get('test_bpc', float('nan')):.4f}  "
                f"train_loss {m.get('train_loss', float('nan')):.4f}  floats/machine "
                f"{m.get('floats_communicated', 0) / 8:.3g}  {time.perf_counter() - start:.0f} s  {outcome['status']}",
                flush=True,
            )
    AdaptiveSlowcal._query_point_of_averages = shipped


if __name__ == "__main__":
    main()
