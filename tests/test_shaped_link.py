"""The shaped-link harness's pure logic (``benchmarks/shaped_link.py``), without root: the commands it would run,
where its processes meet, its one-line refusals, and that what it made is removed when a step fails. Every
command is recorded, none is run: nothing here needs root or makes a namespace."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_shaped_link  # noqa: E402
import shaped_link  # noqa: E402
from shaped_link import IFNAME, Plan, Refused, ShapedLink  # noqa: E402


def _ours(plan: Plan, cmd: list[str]) -> bool:
    """Whether ``cmd`` acts inside the plan's namespaces only."""
    names = set(plan.namespaces())
    if cmd[:3] in (["ip", "netns", "add"], ["ip", "netns", "delete"]):
        return cmd[3] in names
    if cmd[:2] == ["ip", "-n"] or cmd[:3] == ["ip", "netns", "exec"]:
        return cmd[2 if cmd[1] == "-n" else 3] in names
    if cmd[:3] == ["ip", "link", "add"]:  # a veth pair made with both ends in our namespaces at once
        return [cmd[i + 1] for i, word in enumerate(cmd) if word == "netns"] in (
            [plan.namespace(r), plan.switch] for r in range(plan.procs)
        )
    return False


@pytest.mark.parametrize("procs", [2, 4])
def test_every_link_is_shaped_at_both_ends_and_nothing_is_made_outside_the_namespaces(procs):
    plan = Plan(procs, "100mbit", name="t")
    cmds = plan.setup_commands()
    assert all(_ours(plan, c) for c in cmds), [c for c in cmds if not _ours(plan, c)]
    tbf = [c for c in cmds if "tc" in c]
    assert len(tbf) == 2 * procs  # each process's end (what it sends) and the bridge's (what reaches it)
    for rank in range(procs):
        for where, dev in ((plan.namespace(rank), IFNAME), (plan.switch, f"port{rank}")):
            assert ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", "100mbit", "burst", "256kb", "latency", "200ms"] in tbf  # fmt: skip
    assert sorted(c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]) == sorted(plan.namespaces())
    assert sorted(c[3] for c in plan.teardown_commands()) == sorted(plan.namespaces())


def test_slow_start_after_idle_is_turned_off_in_each_process_namespace_only_when_asked():
    kept, off = Plan(2, "100mbit", name="t"), Plan(2, "100mbit", name="t", slow_start_after_idle=False)
    assert not any("sysctl" in c for c in kept.setup_commands())
    sysctl = [c for c in off.setup_commands() if "sysctl" in c]
    assert sysctl == [
        ["ip", "netns", "exec", f"t-{rank}", "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"]
        for rank in range(2)
    ]
    assert all(_ours(off, c) for c in off.setup_commands())


def test_an_unshaped_plan_makes_the_same_namespaces_without_tc():
    shaped, unshaped = Plan(4, "1gbit", name="t"), Plan(4, None, name="t")
    assert not any("tc" in c for c in unshaped.setup_commands())
    assert [c for c in shaped.setup_commands() if "tc" not in c] == unshaped.setup_commands()


def test_the_processes_meet_on_rank_0_s_address_over_their_shaped_ends():
    plan = Plan(4, "100mbit", name="t")
    env = plan.process_env(3, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.77.0.1",
                   "MASTER_PORT": str(shaped_link.PORT), "GLOO_SOCKET_IFNAME": IFNAME}  # fmt: skip
    assert plan.process_command(3, ["python", "x.py"]) == ["ip", "netns", "exec", "t-3", "python", "x.py"]
    assert [f"{plan.address(r)}/24" for r in range(4)] == [
        c[5] for c in plan.setup_commands() if c[3:5] == ["addr", "add"]
    ]


def _allowed(monkeypatch):
    monkeypatch.setattr(shaped_link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(shaped_link, "effective_capabilities", lambda: (1 << 41) - 1)
    monkeypatch.setattr(shaped_link.shutil, "which", lambda tool: f"/usr/sbin/{tool}")


@pytest.mark.parametrize(
    "case, said",
    [
        ("not root", "not root (effective uid 1000)"),
        ("no CAP_NET_ADMIN", "root without CAP_NET_ADMIN"),
        ("no capabilities", "root without CAP_NET_ADMIN and CAP_SYS_ADMIN"),
        ("no tc", "no `tc` on the PATH"),
        ("no ip", "no `ip` on the PATH"),
    ],
)
def test_it_refuses_in_one_line_where_namespaces_cannot_be_made_and_runs_nothing(monkeypatch, capsys, case, said):
    _allowed(monkeypatch)
    if case == "not root":
        monkeypatch.setattr(shaped_link.os, "geteuid", lambda: 1000)
    elif case == "no CAP_NET_ADMIN":
        monkeypatch.setattr(shaped_link, "effective_capabilities", lambda: ((1 << 41) - 1) & ~(1 << 12))
    elif case == "no capabilities":
        monkeypatch.setattr(shaped_link, "effective_capabilities", lambda: 0)
    else:
        missing = case.split()[1]
        monkeypatch.setattr(shaped_link.shutil, "which", lambda tool: None if tool == missing else f"/bin/{tool}")
    ran: list = []
    monkeypatch.setattr(shaped_link.subprocess, "run", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(shaped_link.subprocess, "Popen", lambda *a, **k: ran.append(a))
    why = shaped_link.refusal()
    assert why is not None and said in why and "\n" not in why
    with pytest.raises(Refused, match="^" + re.escape(why) + "$"):
        ShapedLink(Plan(2, name="t")).__enter__()
    assert shaped_link.main(["--procs", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err == f"shaped_link: refused: {why}\n"
    assert ran == []  # not one command: nothing made, nothing to remove


def test_capabilities_are_read_from_the_status_file(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t0000000000001000\n")
    assert shaped_link.effective_capabilities(str(status)) == 1 << shaped_link.CAP_NET_ADMIN
    assert shaped_link.effective_capabilities(str(tmp_path / "missing")) == 0


@pytest.mark.parametrize("fails_at", ["netns add", "tbf", "process", "interrupt"])
def test_what_was_made_is_removed_when_a_step_fails_or_is_interrupted(monkeypatch, fails_at):
    _allowed(monkeypatch)
    plan = Plan(4, "100mbit", name="t")
    done: list[list[str]] = []

    class Result:
        returncode, stdout, stderr = 0, "", ""

    def run(cmd, **kwargs):
        if fails_at == "netns add" and cmd == ["ip", "netns", "add", plan.namespace(2)]:
            Result.returncode, Result.stderr = 1, "Cannot create namespace file: Permission denied\nmore"
        elif fails_at == "tbf" and "tbf" in cmd:
            Result.returncode, Result.stderr = 2, "Error: Specified qdisc kind is unknown."
        else:
            Result.returncode, Result.stderr = 0, ""
        done.append(cmd)
        return Result

    monkeypatch.setattr(shaped_link.subprocess, "run", run)
    monkeypatch.setattr(shaped_link, "_namespaces", lambda: ["someone-elses"])
    killed: list[int] = []
    monkeypatch.setattr(shaped_link.os, "killpg", lambda pid, sig: killed.append(pid))

    class Process:
        count = 0

        def __init__(self, argv, env, start_new_session):
            assert start_new_session and argv[:3] == ["ip", "netns", "exec"]
            self.pid, self.returncode = 1000 + Process.count, None
            Process.count += 1

        interrupted = False

        def poll(self):
            if fails_at == "interrupt" and not Process.interrupted:
                Process.interrupted = True
                raise KeyboardInterrupt  # Ctrl-C while the harness waits
            if self.pid == 1001:
                self.returncode = 3  # rank 1 fails; the others would wait for it
            return self.returncode

        def wait(self):
            self.returncode = -9

    monkeypatch.setattr(shaped_link.subprocess, "Popen", Process)
    link = ShapedLink(plan)
    made = plan.namespaces()[:3] if fails_at == "netns add" else plan.namespaces()
    if fails_at in ("netns add", "tbf"):
        with pytest.raises(Refused, match="failed: (Cannot create namespace file|Error: Specified qdisc)"):
            link.__enter__()
    else:
        with pytest.raises(KeyboardInterrupt) if fails_at == "interrupt" else _nothing():
            with link as net:
                codes = net.run(["python", "x.py"])
        assert killed == [1000, 1002, 1003]  # those still running; rank 1 had failed
        if fails_at == "process":
            assert codes == [-9, 3, -9, -9] and link.stopped == [0, 2, 3]  # main() reports rank 1's 3, not -9
    deleted = [c[3] for c in done if c[:3] == ["ip", "netns", "delete"]]
    assert sorted(deleted) == sorted(made) and link.made == []


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_model_reads_tc_s_rates_as_the_library_s_links():
    assert bench_shaped_link.link_of("100mbit").bandwidth == 12.5e6
    assert bench_shaped_link.link_of("1gbit", 1e-4) == bench_shaped_link.Link.parse("1Gbit/s,100us")
    with pytest.raises(ValueError, match="Invalid rate: '1gbps'"):
        bench_shaped_link.link_of("1gbps")


def test_a_subprocess_run_is_not_needed_to_plan(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    Plan(4, "1gbit").setup_commands()


@pytest.mark.parametrize("procs", ["0", "251"])
def test_a_bad_process_count_is_one_line_and_makes_nothing(monkeypatch, capsys, procs):
    """``--procs 0`` printed a traceback."""
    _allowed(monkeypatch)
    monkeypatch.setattr(shaped_link.subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    assert shaped_link.main(["--procs", procs, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shaped_link: refused: Invalid procs: {procs} (") and err.count("\n") == 1


def test_main_reports_the_status_of_the_process_that_failed_not_of_those_it_stopped(monkeypatch):
    """Rank 1 exits 3 while rank 0 waits: the harness stops rank 0 (-9) and exited 137 instead of 3."""

    class Net:
        stopped = [0]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, command, timeout):
            return [-9, 3]

    monkeypatch.setattr(shaped_link, "ShapedLink", lambda plan: Net())
    assert shaped_link.main(["--", "true"]) == 3


def test_time_to_accuracy_runs_a_sweep_files_trial_on_the_processes_as_nodes(tmp_path):
    """A run is its sweep file's command and one value a parameter (the seed given, a list's first), extra
    arguments last; each process a node of one device (RANK as NODE_RANK, LOCAL_RANK 0)."""
    import bench_time_to_accuracy as tta

    label, fit = tta.trial_command("ddp=sweeps/time_to_accuracy/cnn_ddp.yaml --compression=int8", seed=3)
    assert label == "ddp"
    assert fit[:2] == ["--config", "configs/paper.yaml"] and "--model.arch=cnn" in fit
    assert fit[-7:] == ["--method=minibatch_sgd", "--num_machines=16", "--local_steps=1", "--seed_everything=3",
                        "--model.lr=0.215", "--eval_every=8", "--compression=int8"]  # fmt: skip
    assert tta.NODE == 'NODE_RANK=$RANK LOCAL_RANK=0 exec "$@"'
    with pytest.raises(ValueError, match="Invalid run: 'cnn.yaml'"):
        tta.trial_command("cnn.yaml", seed=1)


def test_time_to_accuracy_counts_the_ring_of_processes_not_of_machines():
    """M = 16 machines on P = 2 processes: a round's all-reduce of B bytes is 2 (M - 1) / M B and 2 (M - 1) hops on
    the machines' ring, B and 2 hops on the processes' (closed form)."""
    import bench_time_to_accuracy as tta

    B = 90_192.0
    row = {"ring_bytes_per_machine": 3 * 2 * 15 / 16 * B, "ring_hops": 3 * 2 * 15}  # three rounds
    sent, hops = tta.on_processes(row, machines=16, procs=2)
    assert sent == pytest.approx(3 * B, rel=1e-15) and hops == pytest.approx(3 * 2, rel=1e-15)
    assert tta.on_processes(row, machines=16, procs=16) == (row["ring_bytes_per_machine"], row["ring_hops"])
    assert tta.rate_bits("100mbit") == 1e8 and tta.rate_bits("1gbit") == 1e9
    with pytest.raises(ValueError, match="Invalid rate: '100mb'"):
        tta.rate_bits("100mb")
