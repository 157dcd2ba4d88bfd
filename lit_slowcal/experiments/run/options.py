"""The training CLI's command line: its options, the settings linked from them, and one-line refusals.

The four experiment settings live at the top level of the config, each in one place: ``method``,
``num_machines`` (M), ``local_steps`` (K) and ``batch_size`` (b). While the command line is parsed,
they are checked (``lit_slowcal.experiments.train.shape.check_settings``: a method, M, K or b no run can
have is refused before anything is built) and a few settings are copied from them into the model, the
data and the trainer (``PARSE_LINKS``): the method and M, the evaluation interval and the seeds. What
follows from them, K's steps per round, per-step batch and sync period, the machines per process and the
rounds, is not computed here: the run's ``RunShape`` owns it, built by the CLI once the problem is known
(``lit_slowcal.experiments.run.cli``); the data module's ``data.steps_per_round`` and ``data.batch_size``
are unset unless a config file of an earlier version gives them, and then must agree with it. A refusal
is one line, ``lit_slowcal: error: <field, value and what is allowed>`` (``OneLineErrorParser``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch
from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser

from lit_slowcal._selection import check_state_keys
from lit_slowcal._validation import check_int, check_number, is_int
from lit_slowcal.compression import NAMES as COMPRESSIONS
from lit_slowcal.compression import TOPK_SPELLING, compressor
from lit_slowcal.experiments.run.threads import THREADS_TYPE
from lit_slowcal.experiments.train.methods import method_names
from lit_slowcal.experiments.train.shape import check_settings, steps_between_syncs
from lit_slowcal.link import Link
from lit_slowcal.options import AveragingOptions, Participation, check_overlap

__all__ = [
    "PARSE_LINKS", "PARSE_LINK_SOURCES", "ConfigFile", "OneLineErrorParser", "add_options", "modelled_link", "one_line_message",
]  # fmt: skip

_LINK_PREFIX = re.compile(r"^Call to compute_fn of link '.*?' with args \(.*?\) failed: ", re.S)


_UNION = re.compile(
    r'^Parser key "(?P<key>[^"]+)":.*Does not validate against any of the Union subtypes Subtypes: \[(?P<types>.*?)\] Errors:.*Given value: (?P<value>.*)$'
)
_TYPE_NAMES = {"<class 'float'>": "a number", "<class 'int'>": "an integer", "<class 'NoneType'>": "null", "<class 'bool'>": "true or false",
               "<class 'str'>": "a string"}  # fmt: skip


def one_line_message(message: Any) -> str:
    """A refusal of the parser on one line: without the name of the link function that checked the value, and
    a value none of a Union's types takes as ``key: value is not <the types>``."""
    return _short_union_error(" ".join(_LINK_PREFIX.sub("", str(message)).split()))


def _short_union_error(message: str) -> str:
    """jsonargparse's refusal of a value none of a Union's types takes, as ``key: value is not <the types>``."""
    match = _UNION.match(message)
    if match is None:
        return message
    allowed = []
    for part in re.findall(r"typing\.Literal\[[^\]]*\]|<class '[^']*'>", match["types"]):
        if part.startswith("typing.Literal"):
            allowed.append("one of " + part[len("typing.Literal[") : -1])
        elif part == "<class 'lit_slowcal.experiments.data.problems.Problem'>":
            from lit_slowcal.experiments.data.problems import PROBLEMS

            allowed.append(f"a problem ({', '.join(PROBLEMS)}, or a Problem's import path)")
        else:
            allowed.append(_TYPE_NAMES.get(part, part.replace("<class '", "").replace("'>", "")))
    return f"{match['key']}: {match['value']!r} is not {' or '.join(allowed)}"


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser whose refusals are one line, ``lit_slowcal: error: <message>`` (exit status 2).

    The message is jsonargparse's, without the usage it prints before it and without the name of the link
    function that checked the value (the check's own message names the field, the value and what is
    allowed). ``exit_on_error=False`` and jsonargparse's debug mode (``JSONARGPARSE_DEBUG``) keep
    jsonargparse's own behaviour. A parse (``parse_args``, ``parse_object``) ends with the check of the four
    experiment settings (``check_settings``).
    """

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        return self._checked(super().parse_args(*args, **kwargs))

    def parse_object(self, *args: Any, **kwargs: Any) -> Any:
        return self._checked(super().parse_object(*args, **kwargs))

    def _checked(self, config: Any) -> Any:
        """``config`` once its section (the subcommand's, or the whole of it) has a method, M, K and b a run
        can have; else refused in one line, as the subcommand's parser refuses its own values."""
        subcommand = config.get("subcommand")
        section = config.get(subcommand) if subcommand else config
        if section is not None and all(k in section for k in ("method", "num_machines", "local_steps", "batch_size")):
            try:
                check_settings(
                    section["method"], section["num_machines"], section["local_steps"], section["batch_size"]
                )
            except ValueError as err:
                self.error(str(err), command=subcommand)
        return config

    def error(self, message: str, *args: Any, command: Optional[str] = None, **kwargs: Any) -> Any:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, *args, **kwargs)
        message = one_line_message(message)
        prog = self.prog.replace(" [options]", "") + (f" {command}" if command else "")
        print(f"lit_slowcal: error: {message} (`{prog} --help` lists the options)", file=sys.stderr, flush=True)
        self.exit(2)


class ConfigFile(ActionConfigFile):
    """``--config``: a file that is empty or not text is refused naming it (jsonargparse would say only
    "Unexpected config:" or a decode error)."""

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: Optional[str] = None) -> None:
        path = Path(str(values))
        if path.is_file():
            data = path.read_bytes()
            if not data.strip():
                parser.error(f"--config {path}: the file is empty; a config file is YAML (key: value lines)")
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                parser.error(f"--config {path}: not a text file ({err}); a config file is YAML")
        super().__call__(parser, cfg, values, option_string)


# The link functions below check the settings while the command line is parsed: before anything is built.


def _num_machines(num_machines: int) -> int:
    return check_int("num_machines", num_machines)


def _eval_every(eval_every: int) -> int:
    # Rounds between evaluations; the run's shape caps it at one epoch once the problem's size is known
    # (RunShape.val_check_interval).
    return check_int("eval_every", eval_every)


def _seed(seed: Any) -> int:
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(
            f"Invalid seed_everything: {seed!r} (must be an integer from 0 to {2**32 - 1}: it seeds torch, numpy and the data split)"
        )
    return seed


#: The settings copied from others while the command line is parsed: (sources, target, compute_fn or None).
#: None computes the run's shape (K's steps per round and per-step batch): ``RunShape`` does, in the CLI.
PARSE_LINKS: tuple[tuple[Any, str, Optional[Callable[..., Any]]], ...] = (
    ("method", "model.method", None),
    ("num_machines", "model.num_machines", None),
    ("num_machines", "data.num_machines", _num_machines),
    ("eval_every", "trainer.val_check_interval", _eval_every),
    ("seed_everything", "data.seed", _seed),
    ("seed_everything", "model.seed", _seed),
)
#: The options other settings are computed from while parsing (``PARSE_LINKS``): a sweep checks every
#: combination of their values (``lit_slowcal.experiments.sweep.checks``), any other option value by value.
PARSE_LINK_SOURCES = frozenset(
    n for sources, _, _ in PARSE_LINKS for n in ((sources,) if isinstance(sources, str) else sources)
)


def links_of(value: Any) -> tuple[Link, ...]:
    """The links of ``--link`` (one string, or a list of them), each checked: one line naming the one refused."""
    texts = [value] if isinstance(value, str) else list(value or ())
    if not texts:
        raise ValueError("Invalid link: [] (give at least one, e.g. 10Gbit/s,1ms)")
    links = []
    for text in texts:
        try:
            links.append(modelled_link(text))
        except ValueError as err:
            if isinstance(text, str) and "," not in text and len(texts) > 1:  # a list split at a link's own comma
                raise ValueError(
                    f'{err}; in a list, quote each link: --link \'["1Gbit/s,10ms","10Gbit/s,1ms"]\''
                ) from None
            raise
    return tuple(links)


def step_seconds_of(value: Any) -> Optional[float]:
    """``--step_seconds``: ``None`` (measured) or a time > 0, at most 1e6 s (any run's compute time then finite)."""
    return None if value is None else float(check_number("step_seconds", value, maximum=1e6))


def compression_options(get: Callable[[str], Any]) -> dict[str, Any]:
    """The strategy's ``compression`` and ``error_feedback`` from ``--compression`` (unset, bf16, int8, int4, int2 or
    ``topk:<fraction>[:<bits>]``) and ``--error_feedback`` (which needs ``--compression``); one line for anything
    else."""
    name, feedback = get("compression"), get("error_feedback")
    if name is not None and name not in COMPRESSIONS:
        if not (isinstance(name, str) and name.startswith("topk:")):
            raise ValueError(
                f"Invalid compression: {name!r} ({', '.join(COMPRESSIONS)}, {TOPK_SPELLING}, or unset: the exact average)"
            )
        compressor(name)  # its fraction and bits, checked: one line
    if feedback is not None and name is None:
        raise ValueError(f"Invalid error_feedback: {feedback!r} (it applies with --compression only; leave it unset)")
    return {"compression": name, "error_feedback": feedback}


def overlap_options(get: Callable[[str], Any]) -> dict[str, Any]:
    """The strategy's ``overlap_delay`` and ``fragments`` from ``--overlap_delay`` and ``--fragments``, checked
    against the run's synchronisation period (tau < K / F, F divides K); one line for anything else."""
    tau, parts = get("overlap_delay"), get("fragments")
    if tau != 0 or parts != 1:
        period = steps_between_syncs(get("method"), get("num_machines"), get("local_steps"), get("batch_size"))
        tau, parts = check_overlap(period, tau, parts)
    return {"overlap_delay": tau, "fragments": parts}


def state_options(get: Callable[[str], Any]) -> dict[str, Any]:
    """The strategy's ``state_every`` from ``--state_every`` (an integer >= 1; 1: the state every round) and its
    ``average_state`` from ``--average_state`` (state keys, comma-separated or a list; unset: none)."""
    return {
        "state_every": check_int("state_every", get("state_every")),
        "average_state": state_keys(get("average_state")),
    }


def state_keys(value: Any) -> tuple[str, ...]:
    """``--average_state``'s keys: ``"exp_avg,exp_avg_sq"`` or ``["exp_avg", "exp_avg_sq"]`` (unset or empty: none);
    one line for anything else."""
    if value is None or value == "":
        return ()
    keys = value.split(",") if isinstance(value, str) else value
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k.strip().isidentifier() for k in keys):
        raise ValueError(
            f"Invalid average_state: {value!r} (optimizer state keys, comma-separated, e.g. exp_avg,exp_avg_sq)"
        )
    return tuple(dict.fromkeys(k.strip() for k in keys))


def check_state_keys_held(keys: tuple[str, ...], optimizer: Any) -> None:
    """One line for a key of ``--average_state`` that ``optimizer`` (the method's, built on a probe parameter) does
    not hold after a step: refused before training, with the averager's own line for it at the first round."""
    probe = next(p for group in optimizer.param_groups for p in group["params"])
    probe.grad = torch.zeros_like(probe)
    optimizer.step()
    check_state_keys(optimizer, keys)


def averaging_options(get: Callable[[str], Any]) -> AveragingOptions:
    """The run's synchronisation options (K from the run's shape, ``--compression``, ``--overlap_delay``, ...),
    checked alone and together by ``AveragingOptions`` itself: one line for anything that cannot work."""
    coded, overlap, state = compression_options(get), overlap_options(get), state_options(get)
    if coded["compression"] is None and overlap == {"overlap_delay": 0, "fragments": 1}:
        return AveragingOptions(**coded, **overlap, **state)  # nothing that depends on K
    period = steps_between_syncs(get("method"), get("num_machines"), get("local_steps"), get("batch_size"))
    return AveragingOptions(sync_every=period, **coded, **overlap, **state)


#: How a round travels (docs/communication.md): (option, type, default, help).
COMMUNICATION_OPTIONS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--compression", Optional[str], None,
     "how a machine's round change travels: bf16, int8, int4, int2 or topk:<fraction>[:<bits>], e.g. topk:0.01:2 "
     "(docs/communication.md); unset: the exact average"),
    ("--error_feedback", Optional[bool], None,
     "with --compression, carry what each message lost into the next round; unset: on"),
    ("--overlap_delay", int, 0,
     "tau: optimizer steps a round's average takes to land while training goes on (0: rounds block; < K / fragments)"),
    ("--fragments", int, 1, "F: the model's parts that take turns, one round every K / F steps (F divides K)"),
    ("--state_every", int, 1,
     "n: the optimizer state a round averages (SLowcal-SGD's w, ...) goes in every n-th round; 1: every round"),
    ("--average_state", Optional[Union[str, list[str]]], None,
     "optimizer state keys a round averages besides the method's own, e.g. exp_avg,exp_avg_sq (AdamW's moments, "
     "which otherwise stay per machine); they go with --state_every's period"),
)  # fmt: skip


#: The run's options before ``COMMUNICATION_OPTIONS``: (option, type, default, help).
RUN_OPTIONS: tuple[tuple[str, Any, Any, Optional[str]], ...] = (
    ("--method", str, "slowcal", None),  # help: the registry's names, when the parser is built
    ("--num_machines", int, 16, "M, machines over all processes"),
    ("--local_steps", int, 16, "K, local steps per round"),
    ("--batch_size", int, 1, "b, samples per machine per local step"),
    ("--eval_every", int, 10, "rounds between test evaluations"),
    ("--run_dir", str, "runs", "folder of the CSV and W&B logs"),
    ("--checkpoint_every", int, 10, "rounds between checkpoints (last.ckpt; 0: epoch ends only)"),
    ("--wandb", bool, True, "log to Weights & Biases (offline without an account)"),
    ("--wandb_project", str, "lit_slowcal", None),
    ("--diagnostics", bool, True,
     "log per-round diagnostics: dispersion before each sync, per-step movement of x (and w)"),
    ("--step_every", int, 10,
     "with --diagnostics: measure the per-step movement of x and w in every N-th round (0: never)"),
    ("--objective", bool, True,
     "log train_objective at every evaluation, and excess_loss, f_star and G_star from x* (float64, cached)"),
    ("--optimum_tol", float, 1e-8,
     "the solver's tolerance on ||grad f(x*)||; with weight decay lambda, f* is then exact to tol^2 / (2 lambda) "
     "(MNIST, lambda = 1e-4: 5e-13)"),
    ("--cache_dir", Optional[str], None,
     "folder of cached optima (default: $XDG_CACHE_HOME/lit_slowcal or ~/.cache/lit_slowcal)"),
    ("--participation", Participation, None,  # int first, whatever Lightning made (lit_slowcal.options)
     "machines taking part in each round: a count S (1..M) or a fraction of M in (0, 1], drawn every round from the "
     "seed; unset: all of them"),
)  # fmt: skip
#: The run's options after ``COMMUNICATION_OPTIONS``: (option, type, default, help).
TIME_OPTIONS: tuple[tuple[str, Any, Any, Optional[str]], ...] = (
    ("--threads", THREADS_TYPE, "auto",
     "torch threads: auto (1 for steps this small, see lit_slowcal/experiments/run/threads.py; keeps "
     "OMP_NUM_THREADS or MKL_NUM_THREADS when set), N, or 0 for torch's default"),
    ("--link", Union[str, list[str]], "10Gbit/s,1ms",
     'the network link(s) the communication time is modelled at: "<bandwidth>,<latency>", e.g. 1Gbit/s,10ms; '
     "several: --link '[\"1Gbit/s,10ms\",\"10Gbit/s,1ms\"]' or --link+=... (docs/library.md)"),
    ("--step_seconds", Optional[float], None,
     "compute time of one optimizer step of one machine on your hardware, for the modelled wall time "
     "(compute + communication); unset: measured on this machine"),
)  # fmt: skip


def add_options(parser: LightningArgumentParser) -> None:
    """The experiment's options (``--method``, ``--num_machines``, ...) and the settings linked from them."""
    for name, kind, default, text in (*RUN_OPTIONS, *COMMUNICATION_OPTIONS, *TIME_OPTIONS):
        text = ", ".join(method_names()) if name == "--method" else text
        parser.add_argument(name, type=kind, default=default, help=text)
    for sources, target, compute_fn in PARSE_LINKS:
        parser.link_arguments(sources, target, compute_fn=compute_fn)
    # The model's shape and loss are the problem's.
    parser.link_arguments("data", "model.input_dim", compute_fn=lambda d: d.problem.input_dim, apply_on="instantiate")
    parser.link_arguments(
        "data", "model.num_classes", compute_fn=lambda d: d.problem.num_outputs, apply_on="instantiate"
    )
    parser.link_arguments("data", "model.loss", compute_fn=lambda d: d.problem.loss, apply_on="instantiate")


#: The links the app models (``modelled_link``): a latency of at most this many seconds (about 11.6 days) ...
MAX_LATENCY = 1e6
#: ... and a bandwidth of at least this many bytes a second (1 bit/s): any run's modelled seconds then stay finite.
MIN_BANDWIDTH = 0.125


def modelled_link(text: str) -> Link:
    """A ``--link`` of the app: ``Link.parse(text)`` within the range where every modelled time stays finite
    (a latency of 0 to 1e6 s, a bandwidth of 1 bit/s or more); one ``ValueError`` line naming what is out."""
    link = Link.parse(text)
    if link.latency > MAX_LATENCY:
        raise ValueError(f"Invalid link latency: {link.latency:g} s in {text!r} (allowed: 0 to {MAX_LATENCY:g} s)")
    if link.bandwidth < MIN_BANDWIDTH:
        raise ValueError(
            f"Invalid link bandwidth: {link.bandwidth:g} B/s in {text!r} (allowed: 1 bit/s = {MIN_BANDWIDTH} B/s or more)"
        )
    return link
