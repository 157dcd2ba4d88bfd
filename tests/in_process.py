"""The command (``python -m lit_slowcal``) run in this process through its own ``main``, on a tiny run
(M = 4, K = 64, b = 64: R = 4 rounds), for the tests of the failures a user can cause."""

from pathlib import Path

from helpers import REPO

from lit_slowcal.experiments.main import main

SMALL = ["--num_machines=4", "--local_steps=64", "--batch_size=64"]  # R = ceil(60000 / 16384) = 4 rounds
RUN = "slowcal_M4_K64_b64_seed1"


def command(capsys, *args: str, run_dir: Path) -> tuple[int, str]:
    """``python -m lit_slowcal fit ...`` in this process: (exit status, stderr)."""
    argv = [*args] if args and args[0] in ("fit", "test", "validate") else ["fit", *args]
    base = [
        f"--config={REPO / 'configs' / 'slowcal.yaml'}",
        f"--data.root={REPO / 'data'}",
        "--wandb=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--run_dir={run_dir}",
    ]
    capsys.readouterr()
    try:
        main([argv[0], *base, *SMALL, *argv[1:]])
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    return code, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The one error line; nothing else on stderr looks like an error or a traceback."""
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("lit_slowcal: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert "weights_only=False" not in stderr  # never advice that weakens safety
    return lines[0]
